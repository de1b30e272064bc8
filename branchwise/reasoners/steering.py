"""Build SkipKV's steering vector (§4.2) from reasoning traces of the model itself.

Why in `reasoners`: building it means running the model the way a reasoner does (chat prompt →
sampled reasoning), then reading one layer's residual input at the newline delimiters that close each
sentence. Execution sentences and non-execution ones (those holding a keyword such as "Wait") give
two means; v = mean(execution) − mean(non-execution), so adding +α·v pushes away from reflection
and transition thoughts. The sentence rules themselves live with the mechanism in
`backends/hf/skipkv.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from branchwise.backends.accel import Accel
from branchwise.backends.base import DecodeParams
from branchwise.backends.hf import HFBackend
from branchwise.backends.hf.skipkv_sentences import SentenceTracker, delimiter_token_ids
from branchwise.backends.hf.skipkv_steering import SteeringVector, steering_path, steering_vector

REFLECTIVE_SYSTEM = (
    "Solve the problem step by step, one short sentence per line. After each step, check it: "
    "if something looks wrong, start a line with 'Wait,' and try again, or with 'Alternatively,' "
    "and take another approach."
)
"""Why a reflective system prompt: a small model rarely writes non-execution thoughts unprompted,
and the vector needs examples of both kinds."""

KEYWORDS = ("Wait", "Alternatively", "again")


def default_layer(n_layers: int) -> int:
    """The paper steers layer 20 of 28 (R1-Qwen-7B) and 35 of 48 (14B): about 70 % of the depth."""
    return min(n_layers - 1, round(0.7 * n_layers))


def delimiter_states(
    backend: HFBackend, prompt: Sequence[int], response: Sequence[int], layer: int, keywords: Sequence[str]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Layer `layer`'s residual input at each sentence-closing delimiter of `response`, split into
    (execution, non-execution) by the sentence the delimiter closes. One teacher-forced forward."""
    tracker = SentenceTracker(delimiter_token_ids(backend.tokenizer), keywords, backend.decode)
    ids = torch.tensor([list(prompt) + list(response)], device=backend.device)
    with torch.inference_mode():
        out = backend.model(input_ids=ids, output_hidden_states=True)
    states = out.hidden_states[layer][0]  # hidden_states[k] is the input of decoder layer k
    tracker.append(response)
    execution: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    for sentence in tracker.sentences:
        if sentence.closed:  # its end is the last of its (merged) delimiters
            h = states[len(prompt) + sentence.end].float().cpu()
            (other if sentence.nonexec else execution).append(h)
    return execution, other


def build_steering(
    backend: HFBackend,
    questions: Sequence[str],
    *,
    layer: int | None = None,
    samples: int = 4,
    max_tokens: int = 256,
    temperature: float = 0.8,
    seed: int = 0,
    system: str = REFLECTIVE_SYSTEM,
    keywords: Sequence[str] = KEYWORDS,
    save: bool = True,
    progress: bool = True,
) -> SteeringVector:
    """Sample `samples` traces per question, collect delimiter states, and fit v (saved per model)."""
    if not questions:
        raise ValueError("questions is empty: build the vector from at least 1 question")
    n_layers = backend.parts.n_layers
    layer = default_layer(n_layers) if layer is None else layer
    if not 0 <= layer < n_layers:
        raise ValueError(f"layer={layer} is outside 0..{n_layers - 1}")
    execution: list[torch.Tensor] = []
    other: list[torch.Tensor] = []
    run = backend.session(accel=Accel())  # traces of the plain model: no eviction, no steering
    for i, question in enumerate(tqdm(questions, desc="steering traces", disable=not progress)):
        prompt = run.chat_prompt(
            [{"role": "system", "content": system}, {"role": "user", "content": question}]
        )
        root = run.prefill(prompt)
        kids = run.fork(root, samples)
        run.release([root])
        try:
            params = DecodeParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i)
            gens = run.extend(kids, params)
        finally:
            run.release(kids)
        for g in gens:
            e, o = delimiter_states(backend, prompt, g.token_ids, layer, keywords)
            execution += e
            other += o
    if not execution or not other:
        raise ValueError(
            f"the traces held {len(execution)} execution and {len(other)} non-execution sentences "
            f"(keywords {list(keywords)}); both are needed: use more questions or samples, or a longer max_tokens"
        )
    vector = SteeringVector(
        layer=layer,
        vector=steering_vector(torch.stack(execution), torch.stack(other)),
        n_exec=len(execution),
        n_nonexec=len(other),
        model=backend.model_name,
    )
    if save:
        vector.save(steering_path(backend.model_name))
    return vector
