"""`megadiff hallucination`: the judge's verdicts on the outputs logged by a real `megadiff lm-eval`
run, asked of an OpenAI-compatible endpoint served here. The fake judge decides by a rule on the
input it is shown (its length modulo 3: no, yes, or no verdict at all), so the expected accuracy
per task follows from the raw sample log alone; it can also rate-limit, then refuse, mid-run."""
from __future__ import annotations

import json
import re
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from megadiff.cli import main
from megadiff.inference import hallucination
from megadiff.inference.hallucination import read_samples
from tests.conftest import kjv_verses
from tests.held_out_runs import held_out_run
from tests.test_lm_eval import write_tasks

lm_eval = pytest.importorskip("lm_eval")

ANSWER_TASK = """task: kjv_answer
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["."], max_gen_toks: 5, do_sample: false}}
metric_list: [{{metric: exact_match}}]
"""
TASKS = ["kjv_choice", "kjv_generate", "kjv_answer"]  # kjv_choice is scored, not generated: never judged
# the judge's last verdict counts; the third gives none
JUDGMENTS = ["The output adds a claim. Verdict: no", "A first verdict: no; but the input supports it. Verdict: **Yes**",
             "Hard to say."]
API_KEY = "sk-test"


@pytest.fixture(scope="module")
def logged(tmp_path_factory) -> Path:
    """`megadiff lm-eval --log-samples --output` of a tiny DIFF checkpoint on three local tasks."""
    root = tmp_path_factory.mktemp("hallucination")
    tasks = write_tasks(root)
    verses = kjv_verses()[:9]
    (root / "kjv_answer.jsonl").write_text("".join(
        json.dumps({"context": verse[:20 + i], "answer": verse[20 + i:]}) + "\n" for i, verse in enumerate(verses)))
    (root / "kjv_answer.yaml").write_text(ANSWER_TASK.format(data=root / "kjv_answer.jsonl"))
    output = root / "generated.json"
    assert main(["lm-eval", "--load", str(held_out_run(root, "diff")[0]), "--tasks", *TASKS, "--include-path",
                 str(tasks), "--dtype", "fp32", "--output", str(output), "--log-samples"]) == 0
    return output


def expected_report(log: Path) -> dict:
    """Per task, from the raw log: the rule the fake judge applies to each generated output's input."""
    report = {}
    for task, samples in json.loads(log.read_text())["samples"].items():
        if task == "kjv_choice":
            continue
        verdicts = [len(sample["arguments"][0][0]) % 3 for sample in samples]
        accurate, no_verdict = verdicts.count(1), verdicts.count(2)
        report[task] = {"outputs": len(verdicts), "accurate": accurate, "no_verdict": no_verdict,
                        "accuracy": accurate / (len(verdicts) - no_verdict)}
    return report


class FakeJudge:
    """/v1/chat/completions: answers the first `statuses` requests with those HTTP errors, then
    judges by rule, answering 401 once `verdicts_before_refusing` verdicts were given. `reply`:
    the body of every 200 reply instead of the rule's judgment."""

    def __init__(self, statuses=(), verdicts_before_refusing: int | None = None, reply: bytes | None = None):
        self.statuses, self.limit = list(statuses), verdicts_before_refusing
        self.bodies, self.headers, self.lock = [], [], threading.Lock()
        self.reply = reply
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 -- http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge.lock:
                    judge.headers.append((self.path, self.headers.get("Authorization")))
                    if judge.statuses:
                        return self.send_error(judge.statuses.pop(0))
                    if judge.limit is not None and len(judge.bodies) >= judge.limit:
                        return self.send_error(401, "invalid api key")
                    judge.bodies.append(body)
                prompt = re.search(r"### Input\n(.*)\n\n### Reference answer", body["messages"][0]["content"],
                                   re.DOTALL)[1]
                reply = judge.reply or json.dumps({"choices": [{"message": {
                    "role": "assistant", "content": JUDGMENTS[len(prompt) % 3]}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()


@pytest.fixture(autouse=True)
def no_waiting(monkeypatch):
    monkeypatch.setattr(hallucination, "RETRY_BACKOFF_S", 0.01)
    monkeypatch.setenv("JUDGE_KEY", API_KEY)


def judge_cli(log: Path | list[Path], judge: FakeJudge, tmp_path: Path, *extra: str) -> int:
    logs = [str(path) for path in (log if isinstance(log, list) else [log])]
    return main(["hallucination", *logs, "--judge-url", judge.url, "--judge-model", "judge-1", "--api-key-env",
                 "JUDGE_KEY", "--records", str(tmp_path / "verdicts.jsonl"), "--output", str(tmp_path / "report.json"),
                 "--workers", "3", *extra])


def test_accuracy_per_task_follows_the_judges_verdicts(logged, tmp_path, capsys):
    with FakeJudge(statuses=[429, 503]) as judge:  # rate-limited, then unavailable: both retried
        assert judge_cli(logged, judge, tmp_path) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["tasks"] == expected_report(logged)
    assert {row["accurate"] for row in report["tasks"].values()} != {0}
    assert sum(row["no_verdict"] for row in report["tasks"].values()) > 0
    assert "kjv_answer" in capsys.readouterr().out
    # each generated output asked once, at temperature 0, with its input, reference and output
    raw = json.loads(logged.read_text())["samples"]
    outputs = [sample for task in ("kjv_generate", "kjv_answer") for sample in raw[task]]
    assert len(judge.bodies) == len(outputs) == 12
    assert {(path, auth) for path, auth in judge.headers} == {("/v1/chat/completions", f"Bearer {API_KEY}")}
    contents = sorted(body["messages"][0]["content"] for body in judge.bodies)
    assert all(body["model"] == "judge-1" and body["temperature"] == 0 for body in judge.bodies)
    for sample in outputs:
        assert any(f"### Input\n{sample['arguments'][0][0]}\n" in content
                   and f"### Reference answer(s)\n{sample['target']}\n" in content
                   and content.endswith(f"### Model output\n{sample['filtered_resps'][0]}") for content in contents)


def test_an_interrupted_run_keeps_its_verdicts_and_a_rerun_asks_only_for_the_rest(logged, tmp_path, capsys):
    with FakeJudge(verdicts_before_refusing=5) as judge:
        assert judge_cli(logged, judge, tmp_path) == 3
    assert "answered 401" in capsys.readouterr().err
    records = tmp_path / "verdicts.jsonl"
    assert len(records.read_text().splitlines()) == 5
    with records.open("a") as out:
        out.write('{"key": "kjv_answer/3/')  # a line a crash cut short: dropped
    with FakeJudge() as judge:
        assert judge_cli(logged, judge, tmp_path) == 0
    assert len(judge.bodies) == 12 - 5
    assert len(records.read_text().splitlines()) == 12 + 1  # every verdict on a line of its own
    assert json.loads((tmp_path / "report.json").read_text())["tasks"] == expected_report(logged)
    with FakeJudge() as judge:  # another judge model: judged anew
        assert judge_cli(logged, judge, tmp_path, "--judge-model", "judge-2") == 0
    assert len(judge.bodies) == 12


def test_a_reply_that_is_no_chat_completion_stops_the_run_and_a_declined_one_gives_no_verdict(
        logged, tmp_path, capsys):
    with FakeJudge(reply=b"<html>proxy login</html>") as judge:  # a proxy's page, answered 200
        assert judge_cli(logged, judge, tmp_path) == 3
    assert "sent no chat completion" in capsys.readouterr().err
    assert not (tmp_path / "verdicts.jsonl").exists() or not (tmp_path / "verdicts.jsonl").read_text()
    declined = json.dumps({"choices": [{"message": {"role": "assistant", "content": None}}]}).encode()
    with FakeJudge(reply=declined) as judge:
        assert judge_cli(logged, judge, tmp_path) == 0
    rows = json.loads((tmp_path / "report.json").read_text())["tasks"].values()
    assert all(row["no_verdict"] == row["outputs"] > 0 for row in rows)


def test_lm_evals_own_sample_files_read_as_ours(logged, tmp_path):
    """lm_eval --log_samples' samples_TASK_DATE.jsonl (written by its own EvaluationTracker) give the
    same outputs as the `megadiff lm-eval --output` JSON they come from."""
    from lm_eval.loggers import EvaluationTracker

    tracker = EvaluationTracker(output_path=str(tmp_path / "results.json"))
    tracker.date_id = datetime.now().isoformat().replace(":", "-")  # as its save_results_aggregated sets it
    for task, samples in json.loads(logged.read_text())["samples"].items():
        tracker.save_results_samples(task, samples)
    files = sorted(tmp_path.glob("samples_*.jsonl"))
    assert len(files) == 3
    assert sorted(read_samples(files), key=repr) == sorted(read_samples([logged]), key=repr)
    assert {sample.task for sample in read_samples(files)} == {"kjv_generate", "kjv_answer"}


def test_mistakes_are_refused_before_the_judge_is_asked(logged, tmp_path, capsys):
    scored_only = tmp_path / "scored.json"
    choice_samples = json.loads(logged.read_text())["samples"]["kjv_choice"]
    scored_only.write_text(json.dumps({"samples": {"kjv_choice": choice_samples}}))
    results_only = tmp_path / "results.json"
    results_only.write_text(json.dumps({"results": {}}))
    binary, listed = tmp_path / "binary.json", tmp_path / "listed.json"
    binary.write_bytes(b"\xff")
    listed.write_text(json.dumps({"samples": "kjv_choice"}))
    other_records = tmp_path / "other.jsonl"
    other_records.write_text(json.dumps({"task": "kjv_choice"}) + "\n")
    with FakeJudge() as judge:
        for log, extra, message in [(tmp_path / "missing.json", (), "no samples file"),
                                    (results_only, (), "holds no samples: run `megadiff lm-eval"),
                                    (scored_only, (), "no generated outputs"),
                                    ([logged, logged], (), "is logged in"),  # two models' outputs mixed
                                    (logged, ("--workers", "0"), "--workers must be >= 1"),
                                    (logged, ("--judge-url", "api.openai.com/v1"), "must be an http"),
                                    (binary, (), "is not a harness sample log"),
                                    (listed, (), "its samples are no mapping of tasks to samples"),
                                    (logged, ("--records", str(logged)), "is a samples file"),
                                    (logged, ("--records", str(tmp_path)), "is a directory"),
                                    (logged, ("--records", str(other_records)), "holds lines that are no verdict"),
                                    (logged, ("--records", str(binary)), "not UTF-8 text")]:
            assert judge_cli(log, judge, tmp_path, *extra) == 2
            assert message in capsys.readouterr().err
        assert judge.headers == []
