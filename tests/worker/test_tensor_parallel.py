"""Tensor parallelism (worker.parallel): shards as loaded, refusals, and 2 gloo ranks on CPU in
spawned processes against a single runner (TP=1) on the same scheduled steps."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import pathlib
import queue
import random
import time
import traceback
from typing import Any

import pytest
import torch

from sluiceway.ports import free_port
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.loader import load_config, load_model
from sluiceway.worker.model import LlamaForCausalLM, ModelConfig
from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk, SequenceData
from sluiceway.worker.parallel import TensorParallelGroup, check_tensor_parallel
from tests.worker.runner_logits import step_logits

BLOCK = 4
WORLD = 2
NUM_DECODE_STEPS = 8
PROMPT_LENS = (3, 11, 6, 17, 1, 9, 24, 5)
# the tiny models of tests/worker/tiny_models.py compared with 2 ranks: untied (4 heads,
# 2 KV heads, vocab 256), qwen2 (qkv bias, tied), llama with o/mlp biases (added after the
# reduce), and the untied one cut to a vocabulary of 255 (a padded last vocab shard)
TP_MODELS = ("llama-untied", "qwen2", "llama3-rope-bias", "vocab-255")

# SmolLM2-135M's config: 9 heads, 3 KV heads
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
}


def _odd_vocab_model(src: pathlib.Path, dst: pathlib.Path, vocab: int) -> pathlib.Path:
    """A copy of the untied tiny model with only the first ``vocab`` token rows."""
    from safetensors.torch import load_file, save_file

    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "vocab_size": vocab}))
    tensors = load_file(src / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = tensors[name][:vocab].contiguous()
    save_file(tensors, dst / "model.safetensors")
    return dst


@pytest.fixture(scope="module")
def tp_models(
    tiny_models: dict[str, pathlib.Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tp")
    models = {k: v for k, v in tiny_models.items() if k in TP_MODELS}
    models["vocab-255"] = _odd_vocab_model(tiny_models["llama-untied"], root / "vocab-255", 255)
    return models


# -- shards as loaded (no process group needed) ----------------------------------------------


def _expected_shard(
    name: str, full: torch.Tensor, tp: TensorParallelGroup, c: ModelConfig
) -> torch.Tensor:
    """The rank's shard of a whole-model parameter, by the Megatron rules (written out
    independently of the loader's)."""
    n, r = tp.world_size, tp.rank
    if name in ("embed_weight", "lm_head_weight"):
        v0, v1 = tp.vocab_range(c.vocab_size)
        out = torch.zeros(tp.vocab_shard_size(c.vocab_size), full.shape[1], dtype=full.dtype)
        out[: v1 - v0] = full[v0:v1]
        return out
    kind = name.rsplit(".", 1)[-1]
    if kind in ("qkv_weight", "qkv_bias"):
        d = c.head_dim
        q, kv = c.num_heads * d, c.num_kv_heads * d
        qs, kvs = q // n, kv // n
        return torch.cat(
            [
                full[r * qs : (r + 1) * qs],
                full[q + r * kvs : q + (r + 1) * kvs],
                full[q + kv + r * kvs : q + kv + (r + 1) * kvs],
            ]
        )
    if kind in ("gate_up_weight", "gate_up_bias"):
        i = c.intermediate_size
        s = i // n
        return torch.cat([full[r * s : (r + 1) * s], full[i + r * s : i + (r + 1) * s]])
    if kind in ("o_weight", "down_weight"):
        s = full.shape[1] // n
        return full[:, r * s : (r + 1) * s]
    return full  # norms, o/down biases: replicated


def _check_shards(model_dir: pathlib.Path, world: int) -> None:
    """Each rank's loaded parameters (created at shard size) equal the slices of the whole."""
    whole = load_model(model_dir).state_dict()
    config = load_config(model_dir)
    for rank in range(world):
        tp = TensorParallelGroup(rank, world)
        shard = load_model(model_dir, tp=tp).state_dict()
        assert shard.keys() == whole.keys()
        for name, full in whole.items():
            torch.testing.assert_close(
                shard[name], _expected_shard(name, full, tp, config), rtol=0, atol=0, msg=name
            )


# and phi3: its checkpoint packs q/k/v and gate/up, sliced part by part
@pytest.mark.parametrize("name", (*TP_MODELS, "phi3"))
def test_loaded_shards_are_the_megatron_slices(
    tiny_models: dict[str, pathlib.Path], tp_models: dict[str, pathlib.Path], name: str
) -> None:
    _check_shards({**tiny_models, **tp_models}[name], WORLD)


def test_loaded_shards_of_a_sharded_checkpoint(tmp_path: pathlib.Path) -> None:
    from tests.worker.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path / "m", "qwen2", seed=4, max_shard_size="40KB")
    assert len(list(folder.glob("*.safetensors"))) > 2
    _check_shards(folder, WORLD)


@pytest.mark.slow
def test_loaded_shards_of_the_converted_gguf() -> None:
    """The embedded SmolLM2 (converted GGUF cache; 9 heads, 3 KV heads) split 3 ways."""
    from sluiceway.model_files import resolve_model

    _check_shards(resolve_model(None), 3)


# -- refusals --------------------------------------------------------------------------------


def test_three_kv_heads_cannot_split_two_ways(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    config = load_config(tmp_path)
    message = (
        r"tensor_parallel_size 2 does not divide the model's 3 KV heads \(num_key_value_heads\)"
    )
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(config, 2)
    with pytest.raises(ValueError, match="3 KV heads"):
        ModelRunner(tmp_path, dtype="float32", tensor_parallel_size=2)
    check_tensor_parallel(config, 3)  # 9 heads, 3 KV heads, 1536 intermediate
    with pytest.raises(ValueError, match="9 attention heads"):  # (not a real GQA layout)
        check_tensor_parallel(dataclasses.replace(config, num_kv_heads=2), 2)
    with pytest.raises(ValueError, match="1537 MLP intermediate size"):
        check_tensor_parallel(dataclasses.replace(config, intermediate_size=1537), 3)
    with pytest.raises(ValueError, match="at least 1"):
        check_tensor_parallel(config, 0)
    with pytest.raises(ValueError, match="3 KV heads"):
        LlamaForCausalLM(config, tp=TensorParallelGroup(0, 2))


def test_a_rank_without_a_process_group_is_refused(tp_models: dict[str, pathlib.Path]) -> None:
    with pytest.raises(RuntimeError, match="init_tensor_parallel"):
        ModelRunner(tp_models["llama-untied"], dtype="float32", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="rank 2 outside"):
        TensorParallelGroup(2, 2)


# -- 2 ranks against 1 -----------------------------------------------------------------------


def _scenario(runner: ModelRunner) -> dict[str, Any]:
    """Prefill 8 prompts of different lengths in one step, then decode them greedily for
    ``NUM_DECODE_STEPS`` steps. Every rank runs it; rank 0's tokens are broadcast (as the
    scheduler would send them to every rank).

    Returns ``tokens`` (generated ids per sequence) and ``logits`` (``[steps, 8, V]`` of the
    sampling rows), plus what ``execute`` returned on this rank.
    """
    import torch.distributed as dist

    rng = random.Random(0)
    vocab = runner.vocab_size
    free = list(range(runner.num_kv_blocks))  # more blocks per rank: half the KV heads
    random.Random(1).shuffle(free)
    seqs: list[SequenceData] = []
    for i, n in enumerate(PROMPT_LENS):
        prompt = [rng.randrange(vocab) for _ in range(n)]
        asks = {"prompt_logprobs": 2} if i == 0 else {}  # its prompt's logits: every row's
        seqs.append(runner.make_sequence(i, prompt, SamplingParams(temperature=0.0, **asks)))
    generated: list[list[int]] = [[] for _ in seqs]
    logits: list[torch.Tensor] = []
    returned: list[int] = []
    for step in range(NUM_DECODE_STEPS + 1):
        chunks = []
        for seq in seqs:
            total = len(seq.token_ids)
            while len(seq.block_table) * BLOCK < total:
                seq.block_table.append(free.pop())
            start = 0 if step == 0 else total - 1
            chunks.append(ScheduledChunk(seq, start, total - start))
        logits.append(torch.stack([x[-1] for x in step_logits(runner, chunks)]))
        out = runner.execute(chunks)
        if step == 0:
            prompt_lps = [(p.seq_id, p.token_ids, p.logprobs, p.ranks, p.top_ids)
                          for p in runner.last_prompt_logprobs]  # fmt: skip
        returned.append(len(out))
        ids = [[t.token_id for t in out]]
        if runner.tp.enabled:
            dist.broadcast_object_list(ids, src=0)
        for seq, gen, token in zip(seqs, generated, ids[0], strict=True):
            seq.token_ids.append(token)
            gen.append(token)
    return {"tokens": generated, "logits": torch.stack(logits), "returned": returned,
            "prompt_logprobs": prompt_lps}  # fmt: skip


def _rank_main(rank: int, port: int, model_dirs: list[str], results: Any) -> None:
    """One spawned rank: join the group, run the scenario on each model, report, and (rank 1)
    die, so that rank 0 sees what a dead peer does to a step."""
    from sluiceway.worker.parallel import destroy_tensor_parallel, init_tensor_parallel

    try:
        torch.set_num_threads(1)
        init_tensor_parallel(rank, WORLD, f"tcp://127.0.0.1:{port}", "cpu", timeout_s=60)
        for model_dir in model_dirs:
            runner = ModelRunner(
                pathlib.Path(model_dir),
                dtype="float32",
                block_size=BLOCK,
                kv_cache_memory=1 << 20,
                tensor_parallel_rank=rank,
                tensor_parallel_size=WORLD,
            )
            out = _scenario(runner)
            out.update(
                logits=out["logits"].numpy(),  # a tensor would travel as a shared fd
                parameter_bytes=runner.parameter_bytes,
                kv_pool_shape=tuple(runner.kv_pool.shape),
                num_kv_blocks=runner.num_kv_blocks,
            )
            results.put((rank, model_dir, out))
        if rank == 1:
            results.close()
            results.join_thread()
            os._exit(0)  # no goodbye: rank 0's next collective must fail, not hang
        seq = runner.make_sequence(99, [1, 2, 3], SamplingParams(temperature=0.0))
        seq.block_table.append(0)
        t0 = time.monotonic()
        try:
            runner.execute([ScheduledChunk(seq, 0, 3)])
            results.put((rank, "dead-peer", "execute returned"))
        except RuntimeError as e:
            results.put(
                (rank, "dead-peer", f"RuntimeError after {time.monotonic() - t0:.1f} s: {e}")
            )
        destroy_tensor_parallel()
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


@pytest.mark.slow
def test_two_gloo_ranks_match_one(tp_models: dict[str, pathlib.Path]) -> None:
    dirs = [str(tp_models[name]) for name in TP_MODELS]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, dirs, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        reference = {}
        for d in dirs:  # TP=1 in this process, while the ranks start
            runner = ModelRunner(
                pathlib.Path(d), dtype="float32", block_size=BLOCK, kv_cache_memory=1 << 20
            )
            reference[d] = (_scenario(runner), runner.parameter_bytes, runner.kv_pool.shape)
        got: dict[tuple[int, str], Any] = {}
        deadline = time.monotonic() + 120
        while len(got) < WORLD * len(dirs) + 1:
            rank, key, value = results.get(timeout=max(1.0, deadline - time.monotonic()))
            assert key != "error", f"rank {rank} failed:\n{value}"
            got[(rank, key)] = value
    except queue.Empty:
        pytest.fail(f"ranks did not report in time; got {sorted(got)}")
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for d, name in zip(dirs, TP_MODELS, strict=True):
        ref, ref_bytes, ref_pool = reference[d]
        assert ref["returned"] == [len(PROMPT_LENS)] * (NUM_DECODE_STEPS + 1)
        for rank in range(WORLD):
            out = got[(rank, d)]
            assert out["tokens"] == ref["tokens"], (name, rank)
            diff = float((torch.from_numpy(out["logits"]) - ref["logits"]).abs().max())
            assert diff <= 1e-4, (name, rank, diff)
            expected_returned = ref["returned"] if rank == 0 else [0] * (NUM_DECODE_STEPS + 1)
            assert out["returned"] == expected_returned
            if rank:  # rank 0 takes the prompt's logprobs, as it samples
                assert out["prompt_logprobs"] == []
            else:
                [(seq_id, ids, lps, ranks, tops)] = out["prompt_logprobs"]
                [(_, ref_ids, ref_lps, ref_ranks, ref_tops)] = ref["prompt_logprobs"]
                assert (seq_id, ids, ranks, tops) == (0, ref_ids, ref_ranks, ref_tops)
                assert len(ids) == PROMPT_LENS[0] - 1
                assert max(abs(a - b) for a, b in zip(lps, ref_lps, strict=True)) <= 1e-4
            ratio = out["parameter_bytes"] / ref_bytes
            print(
                f"{name} rank {rank}: parameters {out['parameter_bytes']} of {ref_bytes} bytes "
                f"({ratio:.3f}), max |logit diff| {diff:.2e}, KV pool {out['kv_pool_shape']}"
            )
            assert 0.45 <= ratio <= 0.6, (name, rank, ratio)
            assert out["kv_pool_shape"][3] == ref_pool[3] // WORLD  # Hkv / N heads per rank
            assert out["num_kv_blocks"] == got[(0, d)]["num_kv_blocks"]
    print("dead peer:", got[(0, "dead-peer")])
    assert got[(0, "dead-peer")].startswith("RuntimeError"), got[(0, "dead-peer")]


@pytest.mark.parametrize(
    ("value", "device", "expected"),
    [
        ("", "cpu", "gloo"),
        ("", "cuda", "nccl"),
        ("gloo", "cuda", "gloo"),
        (" NCCL ", "cuda", "nccl"),
        ("mpi", "cpu", "must be gloo or nccl, got 'mpi'"),
        ("nccl", "cpu", "needs a CUDA device"),
    ],
)
def test_the_backend_override(
    monkeypatch: pytest.MonkeyPatch, value: str, device: str, expected: str
) -> None:
    from sluiceway.worker.parallel import BACKEND_ENV, _backend

    monkeypatch.setenv(BACKEND_ENV, value)
    if expected in ("gloo", "nccl"):
        assert _backend(torch.device(device)) == expected
    else:
        with pytest.raises(ValueError, match=expected):
            _backend(torch.device(device))
