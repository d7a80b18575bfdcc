"""The scheduler's debug `step` event (one per computing step) and scripts/step_attribution.py,
which splits a request's decoding into the steps it waited on from those events."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import sys
from typing import Any

import pytest

from sluiceway.bench.compare import match_label, server_log_path
from sluiceway.internal.v1 import worker_pb2
from sluiceway.scheduler import step_loop
from tests.scheduler.test_scheduler import make_scheduler, make_seq, run_step

ROOT = pathlib.Path(__file__).resolve().parents[2]


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def debug(self, event: str, **fields: Any) -> None:
        self.events.append((event, fields))


def test_a_step_logs_its_rows_prompt_rows_and_each_sequences_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sched = make_scheduler(long_prefill_token_threshold=16)
    sched.add(make_seq(1, prompt_len=5))
    run_step(sched)  # seq 1's prompt: it decodes next
    sched.add(make_seq(2, prompt_len=40))
    out = sched.schedule()  # seq 1's decode row and 16 of seq 2's 40 prompt tokens
    response = worker_pb2.StepResponse(sampled=[worker_pb2.SampledToken(seq_id=1, token_id=7)])
    sent = step_loop.SentStep(sched, out, 7, 1.0, None, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    recorder = Recorder()
    monkeypatch.setattr(step_loop, "log", recorder)
    step_loop.log_step(sent, response, 0.0125)
    assert recorder.events == [
        (
            "step",
            {
                "step_id": 7,
                "ms": 12.5,
                "rows": 17,
                "prompt_rows": 16,
                "seq_ids": [1, 2],
                "emitted": [1, 0],
                "speculating": None,
                "guarded": False,
            },
        )
    ]


def attribution() -> Any:
    spec = importlib.util.spec_from_file_location(
        "step_attribution", ROOT / "scripts/step_attribution.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def step(
    step_id: int, ms: float, seqs: dict[int, int], prompt_rows: int = 0, spec: bool | None = None
) -> str:
    return json.dumps({
        "event": "step", "step_id": step_id, "ms": ms, "rows": 0, "prompt_rows": prompt_rows,
        "seq_ids": list(seqs), "emitted": list(seqs.values()), "speculating": spec,
        "guarded": False,
    })  # fmt: skip


def test_a_requests_decoding_is_split_by_the_steps_it_waited_on(tmp_path: pathlib.Path) -> None:
    module = attribution()
    # seq 5 (request bench-x-0): its prompt in step 1, tokens in steps 1-4; seq 6's prompt
    # arrives in step 3 (a stall for seq 5) and decodes in step 4
    plain = [
        '{"event": "request_added", "request_id": "bench-x-0", "seq_id": 5}',
        "a console line the script skips",
        step(1, 100.0, {5: 1}, prompt_rows=30),
        step(2, 10.0, {5: 1}),
        step(3, 300.0, {5: 1, 6: 1}, prompt_rows=200),
        '{"event": "request_added", "request_id": "bench-x-1", "seq_id": 6}',
        step(4, 12.0, {5: 1, 6: 1}),
    ]
    spec = [
        '{"event": "request_added", "request_id": "bench-y-0", "seq_id": 9}',
        step(1, 100.0, {9: 1}, prompt_rows=30),
        step(2, 30.0, {9: 3}, spec=True),
        '{"event": "request_added", "request_id": "bench-y-1", "seq_id": 10}',
        step(3, 300.0, {9: 0, 10: 1}, prompt_rows=200, spec=False),
        step(4, 11.0, {10: 1}, spec=False),
    ]
    _, steps = module.read_log(write(tmp_path / "a.log", plain))
    decoding = module.decodings(steps)
    assert decoding[5].ms == {"prompt": 300.0, "spec": 0.0, "plain": 22.0}
    assert decoding[5].steps == {"prompt": 1, "spec": 0, "plain": 2}
    assert decoding[6].ms == {"prompt": 0.0, "spec": 0.0, "plain": 12.0}
    seq_of, steps = module.read_log(write(tmp_path / "b.log", spec))
    assert seq_of == {"bench-y-0": 9, "bench-y-1": 10}
    assert module.decodings(steps)[9].ms == {"prompt": 0.0, "spec": 30.0, "plain": 0.0}


def write(path: pathlib.Path, lines: list[str]) -> pathlib.Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_script_reads_the_logs_bench_compare_keeps(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    module = attribution()
    requests = {"continuous": "bench-a", "continuous + spec": "bench-b"}
    for label, run in requests.items():
        lines = []
        for i in range(3):  # three requests one after the other, 2 + i steps of 10 ms each
            seq_id = 10 * i
            lines.append(
                json.dumps({"event": "request_added", "request_id": f"{run}-{i}", "seq_id": seq_id})
            )
            ms = 10.0 if label == "continuous" else 20.0
            lines += [step(100 * i + k, ms, {seq_id: 1}) for k in range(2 + i)]
        write(server_log_path(tmp_path, label), lines)
    result = {
        "configurations": [
            {"label": label, "requests": [
                {"ok": True, "output_len": 2 + i, "request_id": f"{run}-{i}"} for i in range(3)
            ]}
            for label, run in requests.items()
        ]
    }  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(result))
    assert module.main([str(tmp_path / "run.json"), str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "3 requests with 2+ tokens" in printed
    assert "decoding steps' time: P10 2.00, P50 2.00, P90 2.00, P99 2.00" in printed
    assert "    continuous: prompt steps 0.0 s, spec steps 0.0 s, plain steps 0.1 s" in printed


def test_the_script_refuses_what_it_cannot_read_naming_it(tmp_path: pathlib.Path) -> None:
    module = attribution()
    logs = tmp_path / "logs"
    logs.mkdir()
    for label in ("continuous", "continuous + spec"):
        write(server_log_path(logs, label), [
            json.dumps({"event": "request_added", "request_id": "bench-a-0", "seq_id": 1}),
            step(1, 10.0, {1: 1}),
            step(2, 10.0, {1: 1}),
        ])  # fmt: skip
    requests = [{"ok": True, "output_len": 2, "request_id": "bench-a-0"}]
    result = tmp_path / "run.json"

    def save(configurations: dict[str, list[dict[str, Any]]]) -> None:
        result.write_text(json.dumps({"configurations": [
            {"label": label, "requests": r} for label, r in configurations.items()
        ]}))  # fmt: skip

    def refused(*argv: str) -> str:
        with pytest.raises(SystemExit) as e:
            module.main([*argv])
        return str(e.value.code)

    save({"continuous": requests, "continuous + spec": requests})
    assert refused(str(tmp_path / "nothing.json"), str(logs)).endswith(
        "nothing.json: No such file or directory"
    )
    assert refused(str(server_log_path(logs, "continuous")), str(logs)).endswith(
        "continuous.log: not a `bench compare --save-result` JSON (configurations, requests)"
    )
    assert refused(str(result), str(tmp_path / "none")).endswith(
        "none/continuous.log: No such file or directory (bench compare --server-log-dir's directory?)"
    )
    assert refused(str(result), str(logs), "--a", "static") == (
        "--a 'static': not one of the result's configurations ['continuous', 'continuous + spec']"
    )
    assert refused(str(result), str(logs), "--b", "continuous") == (
        "--a and --b name the same configuration, 'continuous'"
    )
    save({"continuous": [{"ok": True, "output_len": 2}], "continuous + spec": requests})
    assert refused(str(result), str(logs)).endswith(
        "continuous.log: names none of the result's requests (a result saved before requests "
        "carried their request_id, or the logs of another run)"
    )
    save({"continuous": requests, "continuous + spec": requests * 2})
    assert refused(str(result), str(logs)) == (
        "'continuous' and 'continuous + spec' ran different requests (not one bench compare)"
    )


def test_a_label_is_named_whole_or_by_the_only_label_it_starts() -> None:
    labels = ["continuous (64)", "continuous", "continuous + spec", "static (batch 32)"]
    assert match_label(labels, "continuous") == "continuous"  # whole, though others start so
    assert match_label(labels, "static") == "static (batch 32)"
    assert match_label(labels, "continuous ") is None  # two start with it
    assert match_label(labels, "transformers") is None
