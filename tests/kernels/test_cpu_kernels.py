"""The C++ CPU kernels (kernels/csrc) against the torch reference and the float64 oracle.

Shapes cover both code paths of the attention kernel: the vectorized one (block size a multiple
of 16, head dim 32/64/96/128) and the generic one (anything else), with grouped-query heads,
prefill chunks over a cached prefix, decodes, block boundaries and NaN garbage in the slots no
sequence owns.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sluiceway.kernels import cpu_ops, onednn_linear
from sluiceway.kernels.backend import get_attention_backend
from sluiceway.kernels.cpu_backend import CpuAttentionBackend
from sluiceway.kernels.paged_attention import key_blocks, kv_pool_shape, value_blocks, write_kv
from sluiceway.sampling_params import SamplingParams
from sluiceway.worker.model import LINEAR_WEIGHTS, _apply_rope, _rms_norm
from tests.kernels.runner_parity import worst_logit_difference
from tests.kernels.test_paged_attention import _run_case

cpu_ops.load()
BACKEND = CpuAttentionBackend()
ROOT = pathlib.Path(__file__).resolve().parents[2]

CASES = [
    [(0, 7)],  # a whole prompt
    [(5, 1), (12, 1), (3, 1)],  # decode only
    [(9, 1), (0, 6), (4, 1), (8, 5), (1, 1)],  # mixed, decodes not contiguous
    [(0, 1)],  # a one-token prompt
    [(16, 4), (15, 1), (0, 16), (31, 33)],  # block boundaries, a chunk of several row tiles
    [(70, 40), (100, 1)],
    [(i * 7 + 3, 1) for i in range(10)],  # >= 4 items a thread: each claims its next ahead
]


@pytest.mark.parametrize("seqs", CASES)
@pytest.mark.parametrize(
    ("hq", "hkv", "d", "block_size"),
    [
        (9, 3, 64, 16),  # SmolLM2: the vectorized path
        (8, 1, 128, 32),  # 8 query heads on one KV head: two lane groups of 4
        (4, 4, 32, 16),
        (6, 2, 80, 16),  # head dim 80: the generic path
        (6, 2, 16, 4),  # block size 4: the generic path
    ],
)
def test_matches_dense_float32(
    seqs: list[tuple[int, int]], hq: int, hkv: int, d: int, block_size: int
) -> None:
    out, ref = _run_case(
        seqs, hq, hkv, d, seed=len(seqs) * 31 + d, dtype=torch.float32, backend=BACKEND,
        block_size=block_size,
    )  # fmt: skip
    assert out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close(dtype: torch.dtype) -> None:
    out, ref = _run_case(
        [(20, 1), (0, 9), (7, 3), (33, 1)], 9, 3, 64, seed=3, dtype=dtype, backend=BACKEND,
        block_size=16,
    )  # fmt: skip
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def _pool_with_sequences(
    lengths: list[int], hkv: int, d: int, block_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache = torch.randn(kv_pool_shape(1, num_blocks, block_size, hkv, d)[1:], generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[perm.pop() for _ in range(-(-n // block_size))] for n in lengths]
    return cache.to(dtype), tables


def _attend(
    query: torch.Tensor,
    cache: torch.Tensor,
    query_lens: list[int],
    context_lens: list[int],
    tables: list[list[int]],
    block_size: int,
) -> torch.Tensor:
    md = BACKEND.build_metadata(
        query_lens, context_lens, tables, block_size=block_size, num_heads=query.shape[1],
        num_kv_heads=cache.shape[2], head_dim=query.shape[2], device="cpu",
    )  # fmt: skip
    return BACKEND.attention(query, cache, md)


@pytest.mark.parametrize("block_size", [16, 4])
def test_a_row_is_bitwise_the_same_whatever_else_is_in_the_step(block_size: int) -> None:
    """Batch invariance in bfloat16: the output of one decode row is bitwise equal alone, in a
    batch of other sequences (before and after it), and as the last row of a prefill chunk
    of its own sequence; each row of a chunk equals that row computed as a decode."""
    hq, hkv, d = 9, 3, 64
    lengths = [200, 37, 64, 1]
    cache, tables = _pool_with_sequences(lengths, hkv, d, block_size, torch.bfloat16, seed=5)
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(sum(lengths), hq, d, generator=gen).to(torch.bfloat16)
    chunk = q[: lengths[0]]  # the queries of sequence 0's positions 0..199
    alone = _attend(chunk[-1:], cache, [1], [200], tables[:1], block_size)
    others = [q[lengths[0] + i : lengths[0] + i + 1] for i in range(3)]
    batch = torch.cat([others[0], chunk[-1:], others[1], others[2]])
    in_batch = _attend(batch, cache, [1] * 4, [37, 200, 64, 1],
                       [tables[1], tables[0], tables[2], tables[3]], block_size)  # fmt: skip
    as_prefill = _attend(chunk, cache, [200], [200], tables[:1], block_size)
    as_chunks = _attend(chunk[150:], cache, [50], [200], tables[:1], block_size)
    assert torch.equal(in_batch[1], alone[0])
    assert torch.equal(as_prefill[-1], alone[0])
    assert torch.equal(as_chunks, as_prefill[150:])
    for pos in (0, 15, 16, 17, 99):
        decode = _attend(chunk[pos : pos + 1], cache, [1], [pos + 1], tables[:1], block_size)
        assert torch.equal(decode[0], as_prefill[pos]), pos


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms_match_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    x, res = torch.randn(37, 576).to(dtype), torch.randn(37, 576).to(dtype)
    w = (torch.rand(576) + 0.5).to(dtype)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), _rms_norm(x, w, 1e-5), **tol)
    summed = x + res
    xx, rr = x.clone(), res.clone()
    cpu_ops.fused_add_rms_norm(xx, rr, w, 1e-5)
    assert torch.equal(rr, summed)  # the sum is rounded once, like torch's add
    torch.testing.assert_close(xx, _rms_norm(summed, w, 1e-5), **tol)
    # a strided input row (a view) works for rms_norm
    wide = torch.randn(5, 1000).to(dtype)
    torch.testing.assert_close(
        cpu_ops.rms_norm(wide[:, :576], w, 1e-6), _rms_norm(wide[:, :576], w, 1e-6), **tol
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = (torch.randn(19, 2 * 1536) * 4).to(dtype)
    x[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    ref = F.silu(x[:, :1536].float()) * x[:, 1536:].float()
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.01}
    torch.testing.assert_close(cpu_ops.silu_and_mul(x).float(), ref, **tol)


def test_bfloat16_rows_round_alike_in_the_vector_and_the_scalar_path() -> None:
    """silu_and_mul writes 16 bfloat16 lanes at a time (cpu_math.h's store16) and the row's
    tail one by one (from_float): the same rounding to nearest even, NaN as 0x7FC0, the same
    bits. A row of 15 goes through the scalar path only, the same 15 values in a row of 16
    through the vector one."""
    up = torch.tensor(
        [1.0, 1.0, 1.0, 1.0, 3.0, -3.0, 1e-3, 7.5, 1.0, 1.0, 1.0, 0.5, 2.0, 1.0, 1.0, 1.0]
    )
    gate = torch.tensor(
        [float("nan"), float("inf"), float("-inf"), -0.0, 1.00390625, -2.5, 1e-38, 0.1,
         -1e-3, 4.0, 88.0, -90.0, 1.0078125, 20.0, -0.5, 3.0]
    )  # fmt: skip
    # both rows hold the same bfloat16 inputs (each rounded once from these)
    x16 = torch.cat([gate, up]).to(torch.bfloat16)[None]
    x15 = torch.cat([gate[:15], up[:15]]).to(torch.bfloat16)[None]
    vector = cpu_ops.silu_and_mul(x16)[0, :15].view(torch.int16)
    scalar = cpu_ops.silu_and_mul(x15)[0].view(torch.int16)
    assert torch.equal(vector, scalar)
    assert int(scalar[0]) == 0x7FC0  # NaN


def test_fast_exp_accuracy() -> None:
    """The kernels' exp (inside silu here): relative error near float32 rounding over the
    whole useful range, 0 far below it."""
    g = torch.linspace(-80, 80, 100_001)
    x = torch.cat([g[:, None], torch.ones(g.numel(), 1)], dim=1)  # up = 1: out = silu(g)
    out = cpu_ops.silu_and_mul(x)[:, 0].double()
    ref = F.silu(g.double())
    rel = ((out - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    assert rel < 1e-6, rel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_write_kv_matches_torch(dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    hq, hkv, d, bs, t = 9, 3, 64, 16, 11
    qkv = torch.randn(t, 1024)[:, : (hq + 2 * hkv) * d].to(dtype)  # row-strided view
    positions = torch.tensor([0, 1, 5, 17, 300, 301, 302, 40, 41, 42, 99])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.arange(512).float()[:, None] * inv[None]
    cos, sin = freqs.cos(), freqs.sin()
    slots = torch.tensor([3, 4, 20, 21, 22, 50, 51, 52, -1, 60, 79])  # -1: write nothing
    cache = torch.zeros(kv_pool_shape(1, 5, bs, hkv, d)[1:], dtype=dtype)
    ref_cache = cache.clone()
    ref_qk = _apply_rope(
        qkv[:, : (hq + hkv) * d].float().view(t, hq + hkv, d),
        cos[positions].unsqueeze(1),
        sin[positions].unsqueeze(1),
    ).to(dtype)
    v = qkv[:, (hq + hkv) * d :].reshape(t, hkv, d)
    keep = slots >= 0
    write_kv(ref_qk[keep, hq:], v[keep], ref_cache, slots[keep])
    out = qkv.clone()
    cpu_ops.rotary_embedding_write_kv(out, positions, cos, sin, cache, slots, hq, hkv)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    torch.testing.assert_close(out[:, : (hq + hkv) * d].view(t, hq + hkv, d), ref_qk, **tol)
    assert torch.equal(out[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :])  # v untouched
    torch.testing.assert_close(cache, ref_cache, **tol)
    # the skipped row wrote nothing: every slot not in `slots` is still 0
    written = set(slots[keep].tolist())
    k_all = key_blocks(cache, d).permute(0, 3, 1, 2).reshape(-1, hkv, d)
    v_all = value_blocks(cache, d).transpose(1, 2).reshape(-1, hkv, d)
    untouched = [s for s in range(5 * bs) if s not in written]
    assert k_all[untouched].count_nonzero() == 0 and v_all[untouched].count_nonzero() == 0


def test_kernels_reject_bad_arguments() -> None:
    q = torch.randn(2, 4, 16)
    cache = torch.randn(2, 3, 2, 4 * 16)
    tables = torch.zeros(2, 1, dtype=torch.int32)
    lens = torch.tensor([1, 1], dtype=torch.int32)
    qsl = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        cpu_ops.paged_attention(q.double(), cache, tables, lens, qsl, 0.25)
    with pytest.raises(RuntimeError, match="int32"):
        cpu_ops.paged_attention(q, cache, tables.long(), lens, qsl, 0.25)
    with pytest.raises(RuntimeError, match=r"\[T, 2 I\]"):
        cpu_ops.silu_and_mul(torch.randn(3, 5))
    with pytest.raises(RuntimeError, match="block 3 outside the pool of 3"):
        cpu_ops.paged_attention(q, cache, tables + 3, lens, qsl, 0.25)
    with pytest.raises(RuntimeError, match="need 2 blocks"):
        cpu_ops.paged_attention(q, cache, tables, lens + 4, qsl, 0.25)
    qkv = torch.randn(2, (4 + 2 * 2) * 16)
    cos = sin = torch.ones(8, 8)
    with pytest.raises(RuntimeError, match="position 8 outside"):
        cpu_ops.rotary_embedding_write_kv(
            qkv, torch.tensor([0, 8]), cos, sin, cache, torch.tensor([0, 1]), 4, 2
        )
    with pytest.raises(RuntimeError, match="positive multiple"):
        cpu_ops.paged_attention(q, cache[:, :, :0], tables, lens, qsl, 0.25)
    with pytest.raises(RuntimeError, match="contiguous"):
        cpu_ops.paged_attention(
            q, cache, tables, torch.tensor([1, 9, 1, 9], dtype=torch.int32)[::2], qsl, 0.25
        )
    with pytest.raises(RuntimeError, match="slot 12 outside"):
        cpu_ops.rotary_embedding_write_kv(
            qkv, torch.tensor([0, 1]), cos, sin, cache, torch.tensor([0, 12]), 4, 2
        )


def test_backend_choice() -> None:
    assert get_attention_backend("auto", "cpu").name == "cpu"
    assert get_attention_backend("cpu", "cpu").fused_layer_ops
    assert not get_attention_backend("torch", "cpu").fused_layer_ops
    with pytest.raises(ValueError, match="CPU only"):
        get_attention_backend("cpu", "meta")


def test_a_failed_build_falls_back_to_torch_and_is_tried_once() -> None:
    """No compiler (the build raises): `auto` takes the torch reference with a warning that
    says why, `cpu` raises, and the build is not attempted again in the process."""
    code = textwrap.dedent(
        """
        import torch.utils.cpp_extension as cpp_extension

        calls = []

        def no_compiler(**kwargs):
            calls.append(kwargs["name"])
            raise RuntimeError("Error building extension: c++: command not found")

        cpp_extension.load = no_compiler
        from sluiceway.kernels import cpu_ops, onednn_linear
        from sluiceway.kernels.backend import get_attention_backend

        assert get_attention_backend("auto", "cpu").name == "torch"
        assert get_attention_backend("auto", "cpu").name == "torch"
        try:
            get_attention_backend("cpu", "cpu")
        except cpu_ops.CpuKernelsUnavailable as e:
            assert "command not found" in str(e), e
        else:
            raise SystemExit("--attention-backend cpu without a compiler did not raise")
        assert len(calls) == 1, calls
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "using the torch reference kernels" in done.stderr


@pytest.mark.parametrize("block_size", [16, 4])
def test_model_runner_cpu_kernels_match_torch(tmp_path: pathlib.Path, block_size: int) -> None:
    """A tiny random Llama in float32, prefill chunks then decodes: logits of the C++ path
    (attention and the fused layer ops) against the torch reference."""
    worst = worst_logit_difference(tmp_path, "cpu", torch.device("cpu"), block_size)
    assert worst < 1e-4, worst


def test_argmax_log_normalizer_matches_torch() -> None:
    torch.manual_seed(4)
    logits = torch.randn(9, 49_157) * 6  # not a multiple of 16: the tail too
    logits[1] = float("-inf")
    logits[2] = 0.5  # a tie everywhere: the first index
    logits[3, [10, 40_000]] = 1e4  # a tie of two maxima
    logits[4, -1] = 1e4  # the maximum in the tail
    logits[5, 3] = float("inf")
    argmax, row_max, shifted = cpu_ops.argmax_log_normalizer(logits)
    lse = row_max + shifted
    assert torch.equal(argmax, logits.argmax(-1))
    assert lse[5] == float("inf")
    ref = torch.logsumexp(logits.double(), -1)
    assert lse[1] == float("-inf")
    finite = torch.isfinite(ref)
    torch.testing.assert_close(lse[finite].double(), ref[finite], atol=1e-5, rtol=1e-6)


def test_apply_token_bitmask_matches_the_unpacked_mask() -> None:
    torch.manual_seed(6)
    vocab = 1000 + 7  # not a multiple of 32: the last word is partial
    logits = torch.randn(5, vocab)
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (5, (vocab + 31) // 32), dtype=torch.int32)
    bitmask[1] = -1  # every token allowed
    bitmask[2] = 0  # none
    bitmask[3, 0] = 1 << 5  # only token 5 of the first word
    bits = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool()
    allowed = bits.flatten(1)[:, :vocab]
    rows = [0, 1, 2, 3]  # row 4 is left as it is
    expected = logits.clone()
    expected[rows] = expected[rows].masked_fill(~allowed[rows], float("-inf"))
    out = logits.clone()
    cpu_ops.apply_token_bitmask(out, bitmask, torch.tensor(rows))
    assert torch.equal(out, expected)
    assert torch.equal(out[4], logits[4]) and torch.isinf(out[2]).all()
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.apply_token_bitmask(out, bitmask, torch.tensor([5]))


def test_sampler_with_cpu_kernels_picks_the_same_tokens() -> None:
    from sluiceway.worker.sampler import sample

    torch.manual_seed(5)
    logits = torch.randn(6, 1000) * 3
    options = [SamplingParams(temperature=0.0)] * 4 + [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
    ]
    gens = [None] * 4 + [torch.Generator().manual_seed(1), None]
    seen = [[1, 2, 3]] * 6
    ref = sample(logits.clone(), options, gens, seen)
    gens[4] = torch.Generator().manual_seed(1)
    mine = sample(logits.clone(), options, gens, seen, cpu_kernels=True)
    assert torch.equal(mine.token_ids, ref.token_ids)
    torch.testing.assert_close(mine.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)


def test_cpu_runner_packs_linear_weights_for_onednn(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the C++ kernels but without the bfloat16 GEMM (a CPU without AVX512-BF16) the
    runner reorders every linear weight once for oneDNN and frees the plain copies; sizes are
    still counted; bfloat16 results equal F.linear's bit for bit; not batch invariant
    (tests/kernels/test_bf16_gemm.py covers the other choice)."""
    monkeypatch.setattr(cpu_ops, "bf16_gemm_supported", lambda: False)
    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk
    from tests.worker.runner_logits import step_logits
    from tests.worker.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", "llama-untied", seed=3)
    runners = {
        name: ModelRunner(
            model_dir, dtype="bfloat16", block_size=16, kv_cache_memory=1 << 20,
            attention_backend=name,
        )
        for name in ("torch", "cpu")
    }  # fmt: skip
    packed = runners["cpu"].model
    assert all(sorted(layer.packed) == sorted(LINEAR_WEIGHTS) for layer in packed.layers)
    assert all(layer.qkv_weight.numel() == 0 for layer in packed.layers)
    assert packed.packed_lm_head is not None and runners["torch"].model.packed_lm_head is None
    assert not runners["cpu"].batch_invariant and not runners["torch"].batch_invariant
    assert runners["cpu"].parameter_bytes == runners["torch"].parameter_bytes
    x = torch.randn(7, packed.config.hidden_size).bfloat16()
    plain = runners["torch"].model.layers[0]
    assert torch.equal(
        onednn_linear.linear(x, packed.layers[0].packed["gate_up_weight"], None),
        F.linear(x, plain.gate_up_weight),
    )
    seq = runners["cpu"].make_sequence(0, [5, 9, 11, 200, 3], SamplingParams(temperature=0.0))
    seq.block_table.append(0)
    logits = step_logits(runners["cpu"], [ScheduledChunk(seq, 0, 5)])[0]
    assert logits.shape == (5, packed.config.vocab_size) and torch.isfinite(logits).all()


def test_greedy_rows_read_bfloat16_logits_as_they_are() -> None:
    """All rows greedy, no penalties, no logprobs: the sampler reads the model-dtype logits
    without a float32 copy; tokens and logprobs equal those from the float32 widening."""
    from sluiceway.worker.sampler import sample

    torch.manual_seed(6)
    logits = (torch.randn(5, 49_160) * 4).bfloat16()
    argmax, row_max, shifted = cpu_ops.argmax_log_normalizer(logits)
    argmax32, row_max32, shifted32 = cpu_ops.argmax_log_normalizer(logits.float())
    assert torch.equal(argmax, argmax32) and torch.equal(row_max, row_max32)
    assert torch.equal(shifted, shifted32)
    greedy = [SamplingParams(temperature=0.0)] * 5
    fast = sample(logits, greedy, [None] * 5, [[1]] * 5, cpu_kernels=True)
    ref = sample(logits.float(), greedy, [None] * 5, [[1]] * 5)
    assert torch.equal(fast.token_ids, ref.token_ids)
    torch.testing.assert_close(fast.logprobs, ref.logprobs, atol=1e-5, rtol=1e-5)
    # a penalty on one row: everything goes through the float32 path, same tokens as before
    mixed = [*greedy[:4], SamplingParams(temperature=0.0, repetition_penalty=2.0)]
    slow = sample(logits, mixed, [None] * 5, [[int(argmax[4])]] * 5, cpu_kernels=True)
    assert slow.logprobs.dtype == torch.float32 and torch.equal(slow.token_ids[:4], argmax[:4])


def test_float16_serves_through_the_cpu_backend(tmp_path: pathlib.Path) -> None:
    """float16 on CPU: the C++ attention and fused ops, no oneDNN packing (its fp16 path needs
    AVX512-FP16), float32 logits for the sampler; greedy steps run and agree with torch."""
    from sluiceway.worker.model_runner import ModelRunner, ScheduledChunk
    from tests.worker.tiny_models import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "llama", "llama-untied", seed=3)
    tokens = {}
    for name in ("torch", "cpu"):
        runner = ModelRunner(
            model_dir, dtype="float16", block_size=16, kv_cache_memory=1 << 20,
            attention_backend=name,
        )  # fmt: skip
        assert runner.model.packed_lm_head is None
        seq = runner.make_sequence(0, [5, 9, 11, 200, 3], SamplingParams(temperature=0.0))
        seq.block_table.append(0)
        first = runner.execute([ScheduledChunk(seq, 0, 5)])
        seq.token_ids.append(first[0].token_id)
        second = runner.execute([ScheduledChunk(seq, 5, 1)])
        tokens[name] = [first[0].token_id, second[0].token_id]
    assert tokens["cpu"] == tokens["torch"]


def test_a_build_lock_left_by_a_killed_build_is_removed(tmp_path: pathlib.Path) -> None:
    """torch waits forever on the build lock of a build killed midway (a worker stopped during
    its first start): under our flock (released by the OS when its holder dies) any torch
    lock is such a leftover, and goes."""
    import fcntl

    build_dir = tmp_path / "build"
    build_dir.mkdir()
    (build_dir / "lock").touch()
    with cpu_ops._build_lock(build_dir):
        assert not (build_dir / "lock").exists()
        with open(build_dir / "sluiceway.flock") as f, pytest.raises(BlockingIOError):
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while torch builds
    with open(build_dir / "sluiceway.flock") as f:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # and released after


def test_the_build_is_keyed_by_the_torch_installation(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two virtualenvs with the same torch version on one machine get a build folder each
    (one folder would be rebuilt at every switch: its build.ninja names one torch's paths)."""
    name = cpu_ops._extension_name()
    assert name == cpu_ops._extension_name()
    other = pathlib.Path("/opt/ci-clone/.venv/lib/python3.11/site-packages/torch/__init__.py")
    monkeypatch.setattr(torch, "__file__", str(other))
    elsewhere = cpu_ops._extension_name()
    assert elsewhere != name and elsewhere.startswith("sluiceway_cpu_")
    assert cpu_ops._extension_name() == elsewhere
    monkeypatch.undo()
    assert cpu_ops._extension_name() == name
