"""One shared decode pass of the scheduler: the jobs' rows made (a prompt prefilled and forked),
each decode step routed to the job it belongs to, jobs answered or cancelled while the pass goes
on, queued jobs admitted into it, and the pass's cost split among its jobs (`Router`).

Why a module of its own: this is the part that runs on the worker thread inside one `extend`,
between decode steps, and it only needs to know the pass it serves: its backend, its counters,
and two questions to the queue beside it (how many rows wait, which jobs may join), which it is
given as callables. It never sees the `Scheduler`, so the scheduler (queue, admission, worker)
imports it and nothing points back; `branchwise.backends.scheduler` says how a pass is started.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from branchwise.backends.base import Admitted, Backend, Cancelled, DecodeStep, Generation, KVStats, ShareMode
from branchwise.backends.scheduler_jobs import BatchStats, InvalidPrompt, Job

__all__ = ["Router", "prompt_share"]

log = logging.getLogger("branchwise.backends.scheduler")  # one logger for the whole scheduler

PLAIN_ROW_TOKENS = 256
"""A one-sample request with a prompt up to this long decodes its prompt's node as a plain row; a
longer one decodes a child that reads the prompt (`Router._fork_prompt`)."""

ADMIT_EVERY = 4
"""Steps a few waiting requests may wait to join a running decode together (`Router.admit`)."""


def prompt_share(job: Job) -> ShareMode | None:
    """How `job`'s rows will hold its prompt (`Router._fork_prompt`): "none" where a lone sample of a
    short prompt decodes the prompt's own node (a plain row: the prompt is its own KV, in its node
    and in its batch tail), "exact" for any other lone sample (its row reads the prompt's node), the
    job's own choice for ``n > 1``. Admission prices the job by it (`Scheduler._kv_cost`)."""
    if job.n == 1:
        return "none" if len(job.prompt) <= PLAIN_ROW_TOKENS else "exact"
    return job.share


class Router:
    """One `extend`'s step listener: hands each job its branches' steps, answers a job once all its
    branches have ended while others still decode, stops the branches of jobs cancelled meanwhile,
    and (continuous batching) admits queued jobs into the running decode.

    Runs on the worker thread between decode steps. Per step it walks the step's rows once; a job
    without a listener costs a dictionary lookup per branch.
    """

    def __init__(
        self,
        backend: Backend,
        stats: BatchStats,
        key: tuple[Any, ...],
        *,
        max_rows: int,
        mixes: bool,
        queued_rows: Callable[[], int],
        take: Callable[[tuple[Any, ...], int], list[Job]],
    ) -> None:
        """A pass of group `key` on `backend`, counted in `stats`, at most `max_rows` rows wide;
        `mixes`: its rows decode with their own jobs' parameters. `queued_rows` and `take` are the
        scheduler's queue (`Scheduler.queued_rows`, `Scheduler._admit`)."""
        self.backend = backend
        self.stats = stats
        self.key = key
        self.max_rows = max_rows
        self.mixes = mixes
        self.queued_rows = queued_rows
        self.take = take
        self.jobs: dict[Job, tuple[int, int]] = {}
        """Each joined job's rows in the call (start, end), in joining order."""
        self.children: list[int] = []
        self.owner: list[tuple[Job, int]] = []
        self.ended: dict[Job, list[Generation | None]] = {}
        self.left: dict[Job, int] = {}
        self.rows_left = 0
        self.steps = 0
        self.admitted_at = 0
        self.finished: list[Job] = []
        """Jobs whose rows all ended (answered or cancelled), in order."""
        self.retiring = 0
        """`finished[:retiring]` had ended when the batch was last re-assembled: none of their rows
        is in the batch now, so their nodes can be released before the call ends."""
        self.released: set[int] = set()
        self.started: set[Job] = set()
        """Jobs whose rows have decoded a token: their rows may be in the batch."""
        self.unstarted_dropped: list[Job] = []
        """Cancelled jobs none of whose rows decoded a token: no row of theirs is in the batch, so
        their nodes (and the KV their prompts computed so far) go at the next `admit`, not when
        the batch is next re-assembled."""

    def join(self, job: Job) -> bool:
        """Prefill and fork `job`'s prompt; its branches become the call's next rows. A job cancelled
        meanwhile fails with `Cancelled`, a prompt the backend refuses fails that job alone
        (`InvalidPrompt`); the call goes on without it."""
        if job.cancelled:
            job._fail(Cancelled("the request was cancelled before it was decoded"))
            return False
        if job.nodes is not None:
            kids = list(job.nodes)
            self.released.update(kids)  # the caller's nodes: never released here
        else:
            try:
                kids = self._fork_prompt(job)
            except ValueError as exc:
                job._fail(InvalidPrompt(str(exc)))
                return False
        a = len(self.children)
        self.children.extend(kids)
        self.jobs[job] = (a, a + len(kids))
        self.owner.extend((job, i) for i in range(len(kids)))
        self.ended[job] = [None] * job.n
        self.left[job] = job.n
        self.rows_left += job.n
        st = self.stats
        st.requests += 1  # counted before decoding: a job answered mid-call finds itself counted
        st.rows += job.n
        job.batch_requests, job.batch_rows = len(self.jobs), len(self.children)
        return True

    def _fork_prompt(self, job: Job) -> list[int]:
        """Prefill the job's whole prompt (a backend with a prefix cache reuses what it holds) and
        fork it into ``n`` branches."""
        backend = self.backend
        root = backend.prefill(job.prompt)
        share = prompt_share(job)
        if job.n == 1 and share == "none":
            # One sample of a short prompt shares it with nobody: decode the prompt's own node. It
            # is a plain row (a one-row shared segment would cost one more attention product per
            # layer), and its KV is the exact prompt, so a backend with a prefix cache keeps it for
            # the next request that starts the same way (DSPy's candidates, an agent's next turn).
            return [root]
        try:
            # A long prompt stays a segment its rows read, out of the batch's tails: a row's tail
            # holds its own tokens, and every row of a batch gets room for the longest one's.
            return backend.fork(root, job.n, share=share)
        finally:
            # the children keep the root's KV alive; releasing it now frees it with them
            backend.release([root])

    def admit(self, alive: int) -> Sequence[Admitted]:
        """`extend`'s ``admit``: queued jobs of this group that fit beside the `alive` rows.

        Admitting re-assembles the batch (about one copy of its rows' own KV), so a few newcomers
        beside many decoding rows wait up to `ADMIT_EVERY` steps to come in together; a batch that
        has shrunk to four times the waiting rows or less takes them at once."""
        self.steps += 1
        self._release_retired()
        room = self.max_rows - alive
        if room < 1:
            return []
        waiting = self.queued_rows()
        if not waiting or (waiting * 4 < alive and self.steps - self.admitted_at < ADMIT_EVERY):
            return []
        self.admitted_at = self.steps
        ended = len(self.finished)
        before = len(self.children)
        for job in self.take(self.key, room):
            if self.join(job):
                self.stats.admitted += 1
        new = self.children[before:]
        if new:  # the batch is re-assembled from the rows still decoding: the jobs that ended by now leave it
            self.retiring = ended
        if not self.mixes:
            return new
        return [(node, job.params) for node, (job, _) in zip(new, self.owner[before:], strict=True)]

    def _release_retired(self) -> None:
        """Release the nodes of jobs that ended before the last re-assembly (continuous batching).

        Without this a call that keeps admitting would hold every answered request's KV until it
        ends, which under a steady load is never. A job's rows leave the batch only when it is
        re-assembled (before that, a finished row may still be copied back into its node), so its
        nodes are released at the first step boundary after that."""
        for job in self.unstarted_dropped:
            nodes = [n for n in self.children[slice(*self.jobs[job])] if n not in self.released]
            self.backend.release(nodes)
            self.released.update(nodes)
        self.unstarted_dropped.clear()
        if not self.retiring:
            return
        nodes = [
            n
            for job in self.finished[: self.retiring]
            for n in self.children[slice(*self.jobs[job])]
            if n not in self.released
        ]
        del self.finished[: self.retiring]
        self.retiring = 0
        if nodes:
            self.backend.release(nodes)
            self.released.update(nodes)

    def account(self, before: KVStats, after: KVStats) -> None:
        """Hand the call's computed tokens to its jobs by the tokens their rows generated; each
        rode every forward of the call."""
        made = {
            job: max(sum(len(g.token_ids) for g in gens if g is not None), 1)
            for job, gens in self.ended.items()
        }
        total = sum(made.values())
        tokens = after.tokens_computed - before.tokens_computed
        forwards = after.forward_calls - before.forward_calls
        for job, n in made.items():
            job.tokens_computed += tokens * n / total
            job.forward_calls += forwards
            job.shared = len(made) > 1

    def unreleased(self) -> list[int]:
        """The call's nodes not released yet (the rest go when the call ends)."""
        return [n for n in self.children if n not in self.released]

    def __call__(self, step: DecodeStep) -> list[int] | None:
        owner = self.owner
        steps: dict[Job, DecodeStep] = {}
        for row, tokens in step.tokens.items():
            job, i = owner[row]
            self.started.add(job)
            if job.on_step is not None and not job.done.is_set():
                steps.setdefault(job, DecodeStep({}, {})).tokens[i] = tokens
        answered = []
        for row, gen in step.finished.items():
            job, i = owner[row]
            self.ended[job][i] = gen
            self.left[job] -= 1
            self.rows_left -= 1
            if job.on_step is not None and not job.done.is_set():
                steps.setdefault(job, DecodeStep({}, {})).finished[i] = gen
            if not self.left[job]:
                answered.append(job)
                self.finished.append(job)
        for job, own in steps.items():
            listener = job.on_step
            if listener is None:
                continue
            try:
                listener(own)
            except Exception:  # a consumer's bug must not stop everyone's decoding
                log.exception("a job's step listener failed; it hears no more steps")
                job.on_step = None
        if not self.rows_left:  # the call ends now: answer with the others, once released
            answered = []
        for job in answered:
            if not job.done.is_set() and not job.cancelled:
                job.generations = [g for g in self.ended[job] if g is not None]
                job._finish()
        return self._drop()

    def _drop(self) -> list[int] | None:
        """The rows of jobs cancelled since the last step (those jobs fail with `Cancelled` now)."""
        drop: list[int] | None = None
        for job, (a, b) in self.jobs.items():
            if job.cancelled and not job.done.is_set():
                job._fail(Cancelled("the request was cancelled while it was decoded"))
                self.rows_left -= self.left[job]  # its rows stop now, unreported
                self.left[job] = 0
                if job in self.started:
                    self.finished.append(job)
                else:
                    self.unstarted_dropped.append(job)
                drop = [*(drop or []), *range(a, b)]
        return drop
