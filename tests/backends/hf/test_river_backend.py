"""River exits inside the backend: KV integrity, fidelity at a threshold nothing passes, composition."""

from __future__ import annotations

import math

import pytest
import torch
from testkit import Rerun

from branchwise.backends import DecodeParams
from branchwise.backends.accel import Accel, RiverConfig
from branchwise.backends.hf import HFBackend, step_replay
from branchwise.backends.hf.river import River
from branchwise.backends.hf.river_quant import torchao_available
from branchwise.reasoners import Reasoner
from branchwise.strategies import beam_search

GREEDY = DecodeParams(temperature=0.0, max_tokens=10, min_tokens=10)
PROMPT = "Reasoning branches explore different paths and vote on the result."


def native_execution(device: torch.device) -> str:
    """How the default river's layers run on `device` (`RiverPath.execution`): torch's fused CPU
    kernels on the CPU (the tiny models' 64-wide Linears qualify), torchao's on CUDA where it is
    installed, else weight-only layers dequantized on every call (which the result's notes say)."""
    if device.type == "cpu":
        return "fused"
    return "torchao" if torchao_available() else "dequantize"


def _river_notes(notes: list[str], device: torch.device) -> list[str]:
    """The result's river notes, less the one that is right where no fused kernel exists (checked
    in `test_dequantize_per_call_fallback_is_a_note`)."""
    river = [note for note in notes if note.startswith("river")]
    if native_execution(device) == "dequantize":
        return [note for note in river if "by dequantizing" not in note]
    return river


def _decode(backend: HFBackend, n: int = 2) -> tuple[list[list[int]], list[int]]:
    root = backend.prefill(backend.encode(PROMPT))
    kids = backend.fork(root, n)
    gens = backend.extend(kids, GREEDY)
    return [g.token_ids for g in gens], [root, *kids]


def test_nothing_exits_equals_backbone_token_for_token(tiny_arch_dir) -> None:
    backend = HFBackend(tiny_arch_dir)
    plain, nodes = _decode(backend)
    backend.release(nodes)
    backend.accel = Accel(river=RiverConfig(threshold=1.0, entry_layer=0))
    backend.reset_stats()
    river, nodes = _decode(backend)
    stats = backend.kv_stats().extra
    assert river == plain
    assert stats["river_forwards"] > 0 and stats.get("river_exits", 0) == 0
    assert stats["river_backbone_layers"] == stats["river_tokens"] * backend.parts.n_layers
    backend.release(nodes)


@pytest.mark.parametrize("kernel", ["dynamic_int8", "weight_only"])
def test_exited_tokens_leave_a_complete_cache(tiny_llama_dir, kernel: str) -> None:
    """Every layer holds K/V for every position; layers up to the exit equal the backbone's exactly."""
    backend = HFBackend(tiny_llama_dir)
    if kernel == "dynamic_int8" and backend.device.type != "cpu":
        pytest.skip("dynamic_int8 runs on CPU only (elsewhere it raises: test_river.py checks the error)")
    backend.accel = Accel(river=RiverConfig(threshold=-1.0, entry_layer=0, kernel=kernel, prefill=True))
    root = backend.prefill(backend.encode(PROMPT))
    (kid,) = backend.fork(root, 1)
    backend.extend([kid], GREEDY)
    stats = backend.kv_stats().extra
    assert stats["river_exits"] == stats["river_forwards"]  # threshold -1: every forward exits at entry
    assert stats["river_backbone_layers"] == stats["river_tokens"]  # one backbone layer per token
    backend.append([kid], [backend.encode(" ok")])
    backend.extend([kid], DecodeParams(max_tokens=1))  # computes the pending tokens too
    segs = [backend.tree.get(root), backend.tree.get(kid)]
    path = backend.tokens(kid)[:-1]  # the last sampled token has no KV yet
    assert sum(s.kv_tokens for s in segs) == len(path)
    keys = [torch.cat([s.keys[layer] for s in segs], dim=1) for layer in range(backend.parts.n_layers)]
    with torch.inference_mode():
        ref = backend.model(torch.tensor([path], device=backend.device), use_cache=True).past_key_values
    for layer in range(backend.parts.n_layers):
        got, want = keys[layer], ref.layers[layer].keys[0]
        assert got.shape == want.shape and torch.isfinite(got).all()
        if layer == 0:  # never skipped: bit-for-bit the backbone's
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # written by the river layer into the same slot: close to, not equal to, the backbone's
            # per head, the cosine of every river slot t with the backbone's key at every position s
            sim = torch.einsum(
                "htd,hsd->hts",
                torch.nn.functional.normalize(got, dim=-1),
                torch.nn.functional.normalize(want, dim=-1),
            )
            own = sim.diagonal(dim1=1, dim2=2)  # slot t against position t
            eye = torch.eye(sim.shape[-1], dtype=torch.bool, device=sim.device)
            other = sim.masked_fill(eye, -2.0).amax(-1)
            # measured: own >= 0.996, any other position <= 0.91 (8-bit weight-only and dynamic int8),
            # so a key written to a wrong slot (or another layer's) fails both bounds
            assert own.min() > 0.99, own.min()
            assert (own - other).min() > 0.05, (own - other).min()
    backend.release([root, kid])


@pytest.mark.parametrize("head", ["refined", "quantized", "backbone"])
def test_tokens_that_do_not_exit_get_the_backbones_logits(tiny_arch_dir, head: str) -> None:
    """Whatever the river's head, a forward that stays on the backbone uses the backbone's head."""
    backend = HFBackend(tiny_arch_dir)
    root = backend.prefill(backend.encode(PROMPT))
    (kid,) = backend.fork(root, 1)
    (plain,) = backend.extend([kid], GREEDY)
    backend.release([root, kid])
    backend.accel = Accel(river=RiverConfig(threshold=1.0, entry_layer=0, head=head))  # type: ignore[arg-type]
    root = backend.prefill(backend.encode(PROMPT))
    (kid,) = backend.fork(root, 1)
    (river,) = backend.extend([kid], GREEDY)
    assert backend.kv_stats().extra.get("river_exits", 0) == 0
    assert river.token_ids == plain.token_ids
    assert river.logprobs == pytest.approx(plain.logprobs, abs=1e-6)
    assert river.top1_probs == pytest.approx(plain.top1_probs, abs=1e-6)
    backend.release([root, kid])


def test_backbone_head_runs_the_models_head_after_an_exit(tiny_llama_dir) -> None:
    """head='backbone': exited tokens' logits come from the model's own head on the river's state."""
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(river=RiverConfig(threshold=-1.0, entry_layer=0, head="backbone"))
    plugin = backend.acceleration(River)
    assert plugin is not None and plugin.path.head is None
    calls = []
    hook = backend.parts.head.register_forward_hook(lambda *_: calls.append(1))
    try:
        _, nodes = _decode(backend, n=1)
    finally:
        hook.remove()
    stats = backend.kv_stats().extra
    assert stats["river_exits"] > 0 and len(calls) >= stats["river_forwards"]
    backend.release(nodes)


def test_river_composes_with_prefix_sharing(tiny_llama_dir) -> None:
    """Same exits, same tokens under exact sharing and the No-KV baseline (weight-only kernel: per-row math)."""
    outs = {}
    for share in ("none", "exact"):
        backend = HFBackend(tiny_llama_dir, share=share)
        backend.accel = Accel(
            river=RiverConfig(threshold=-1.0, entry_layer=1, kernel="weight_only", bits=4, prefill=True)
        )
        outs[share], nodes = _decode(backend, n=3)
        backend.release(nodes)
    assert outs["none"] == outs["exact"]


def test_audit_reports_match_and_kl(tiny_llama_dir) -> None:
    """River's audit (each exited token's river logits against the backbone's own) runs on the fast
    step as on the layer loop: the backbone's rest is one more piece, run before the river's so the
    river's K/V are what the slots keep. Both give the same tokens and the same audit, and the step
    leaves no decode step on the layer loop."""
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(river=RiverConfig(threshold=-1.0, entry_layer=0, audit=True))
    audits = {}
    for mode in ("layers", "eager"):
        backend.decode_step = mode
        backend.reset_stats()
        tokens, nodes = _decode(backend)
        stats = backend.kv_stats().extra
        backend.release(nodes)
        assert stats["river_audit_rows"] == stats["river_exit_tokens"] > 0  # each exited token, audited
        matches, rows, kl = (
            stats["river_audit_matches"],
            stats["river_audit_rows"],
            stats["river_audit_kl_sum"],
        )
        assert matches <= rows and math.isfinite(kl)
        # a token picked differently came from a different distribution: then the divergence is positive
        assert kl > 0.0 or matches == rows
        audits[mode] = (tokens, rows, matches, kl)
    stats = backend.kv_stats().as_dict()
    assert "decode_steps_layer_loop" not in stats and stats["decode_steps_fixed"] >= GREEDY.max_tokens - 1
    (loop_tokens, *loop), (step_tokens, *step) = audits["layers"], audits["eager"]
    assert step_tokens == loop_tokens and step[:2] == loop[:2] and step[2] == pytest.approx(loop[2], rel=1e-3)


def test_river_under_a_tree_strategy_and_notes(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    strategy = beam_search(
        width=4, depth=2, verifier="chain_sum", max_step_tokens=8, step_delimiter="\n", seed=0
    )
    result = Reasoner(
        strategy, backend=backend, accel=Accel(river=RiverConfig(threshold=-1.0, entry_layer=0))
    ).run("1 + 2?")
    assert result.kv_stats["river_exits"] > 0
    assert not _river_notes(result.notes, backend.device)
    result = Reasoner(
        strategy, backend=backend, accel=Accel(river=RiverConfig(threshold=1.0, entry_layer=0))
    ).run("1 + 2?")
    assert any(note.startswith("river: no forward") for note in result.notes)


def test_bad_entry_layer_names_the_field(tiny_llama_dir) -> None:
    backend = HFBackend(tiny_llama_dir)
    with pytest.raises(ValueError, match="entry_layer"):
        backend.accel = Accel(river=RiverConfig(entry_layer=2))  # 3 layers: entry must be 0..1


def test_dequantize_per_call_fallback_is_a_note(tiny_llama_dir, monkeypatch) -> None:
    """Where no fused kernel takes the river's layers (CUDA without torchao, or CPU shapes the int8
    kernel refuses: forced here on the tiny model), exits dequantize every weight per call; the
    result says so in its notes, not only in a warning at build time."""
    from branchwise.backends.hf import river_quant
    from branchwise.strategies import self_consistency

    backend = HFBackend(tiny_llama_dir)
    strategy = self_consistency(n=2, max_tokens=4, seed=0)
    accel = Accel(river=RiverConfig(threshold=-1.0, entry_layer=0))
    if native_execution(backend.device) != "dequantize":  # a fused kernel takes the layers: no note
        fused = Reasoner(strategy, backend=backend, accel=accel).run("1 + 2?")
        assert fused.kv_stats["river_exits"] > 0 and "river_dequantize_exits" not in fused.kv_stats
        assert not any(note.startswith("river") for note in fused.notes)
        monkeypatch.setattr(river_quant, "int8_cpu_kernel_ok", lambda *args: False)
        monkeypatch.setattr(river_quant, "torchao_available", lambda: False)
        backend = HFBackend(tiny_llama_dir)  # a fresh build cache: the river is built unfused
    # (CUDA without torchao needs no forcing: the default river dequantizes there)
    result = Reasoner(strategy, backend=backend, accel=accel).run("1 + 2?")
    path = backend.session(accel=accel).plugin(River)
    assert path is not None and path.path.execution == "dequantize"
    exits = result.kv_stats["river_exits"]
    assert exits > 0 and result.kv_stats["river_dequantize_exits"] == exits
    (note,) = [n for n in result.notes if n.startswith("river")]
    assert note.startswith(
        f"river: {exits:g} exited forward(s) ran the river's weight-only layers by dequantizing"
    )
    assert "branchwise[gpu]" in note


@pytest.mark.parametrize(("threshold", "chunk"), [(-1.0, 8), (0.7, 8), (-1.0, 1)])
def test_exits_on_the_fast_step_match_the_layer_loop(
    tiny_llama_dir, threshold: float, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """River's exits on the fixed-shape step, as pieces with one host read per candidate layer
    (eager, and recorded piece by piece): the layer loop's greedy tokens (fp32), the same exits
    at the same layers, and no decode step on the layer loop or off the fast step. At 0.7 the tiny
    model's steps exit at layer 0, at layer 1 or not at all. With the river cut into pieces of one
    layer (`step_replay.RIVER_CHUNK`), an exit's rest of the stack is a chain of pieces."""
    monkeypatch.setattr(step_replay, "RIVER_CHUNK", chunk)
    backend = HFBackend(tiny_llama_dir)
    backend.accel = Accel(river=RiverConfig(threshold=threshold, entry_layer=0))
    runs = {}
    for mode, recorder in (("layers", None), ("eager", None), ("eager", Rerun())):
        backend.decode_step = mode
        if recorder is not None:
            backend.engine.stepper.recorder = recorder
        backend.reset_stats()
        root = backend.prefill(backend.encode("What is 12 + 7? Think step by step."))
        kids = backend.fork(root, 3)
        backend.extend(kids, DecodeParams(max_tokens=16, min_tokens=16))
        runs[mode, recorder is not None] = ([backend.tokens(k) for k in kids], backend.kv_stats().as_dict())
        backend.release([root, *kids])
    loop_tokens, loop = runs["layers", False]
    keys = ("river_exits", "river_decode_tokens", "river_decode_backbone_layers")
    for (mode, recorded), (tokens, stats) in runs.items():
        assert tokens == loop_tokens, (mode, recorded)
        assert {k: stats.get(k) for k in keys} == {k: loop.get(k) for k in keys}, (mode, recorded)
        if mode == "eager":
            assert "decode_steps_layer_loop" not in stats and "decode_steps_off_fast" not in stats
            assert stats.get("decode_steps_captured", 0) >= (10 if recorded else 0)
    # every step exits at the first candidate layer; or some steps exit, at either, and some do not
    steps = loop["river_forwards"] - loop.get("river_exits", 0)
    assert loop["river_exits"] > 0 and (steps > 0) is (threshold > 0)
