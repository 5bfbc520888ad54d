"""`megadiff hallucination`: the DIFF paper's contextual-hallucination evaluation (its Table 4).

The paper follows Chuang et al. (2024, Lookback Lens): a model summarizes (XSum, CNN/DM,
MultiNews) or answers questions about given documents (Qasper, HotpotQA, 2WikiMQA from
LongBench), and a judge model (GPT-4o) decides for each of 100 outputs per dataset whether it is
accurate and free of hallucination given the input and the reference answers. Here the outputs
come from the lm-evaluation-harness's sample logs (`megadiff lm-eval --log-samples --output
FILE.json`, or `lm_eval --log_samples`' samples_TASK_DATE.jsonl for a Hugging Face export), and
the judge is any OpenAI-compatible chat endpoint. The judge's instructions are our wording of
that protocol: compare models under one judge, not with the paper's numbers.

Each verdict is appended to a records file as it arrives, so an interrupted run (or a judge's
rate limit outlasting the retries) loses none that were paid for: a rerun asks only for the rest.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.table import Table

from megadiff.config import ConfigError
from megadiff.console import progress_bars
from megadiff.errors import MegadiffError
from megadiff.inference.records import append_record, lines_of, read_records, utf8_input
from megadiff.inference.reporting import command_console, write_report

JUDGE_INSTRUCTIONS = """Below are the input a language model was given, the reference answer(s) and the model's output.

Decide whether the output is accurate and free of hallucination: everything it states must be supported by the \
input. An output worded differently from the references is still accurate when the input supports it; an output that \
states anything the input does not support, or contradicts it, is not. An empty or off-task output is not accurate.

Explain briefly, then end with the line "Verdict: yes" (accurate, no hallucination) or "Verdict: no".

### Input
{prompt}

### Reference answer(s)
{reference}

### Model output
{response}"""
VERDICT = re.compile(r"verdict\W*(yes|no)\b", re.IGNORECASE)
# lm_eval's sample logs: samples_<task>_<date id>.jsonl
SAMPLES_FILE = re.compile(r"samples_(?P<task>.+)_\d{4}-\d{2}-\d{2}T[\d.\-]+\.jsonl$")
RETRIED_STATUS = (408, 409, 429, 500, 502, 503, 504)
# a rate-limited judge is asked again after 2, 4, ... 64 s, then the run stops (its verdicts kept)
RETRIES, RETRY_BACKOFF_S, REQUEST_TIMEOUT_S = 6, 2.0, 300.0


class JudgeError(MegadiffError):
    """The judge endpoint refused or kept failing; the verdicts so far are kept."""


@dataclass(frozen=True)
class Sample:
    """One generated output of a harness task, with what the judge needs."""
    task: str
    doc_id: int
    prompt: str
    response: str
    reference: str

    def key(self, judge_model: str) -> str:
        """Names the verdict: another output or another judge is judged anew."""
        digest = hashlib.sha256(f"{judge_model}\0{self.prompt}\0{self.response}".encode()).hexdigest()[:16]
        return f"{self.task}/{self.doc_id}/{digest}"


def _generation(task: str, sample: dict) -> Sample | None:
    """A Sample from a logged harness sample; None for a log-likelihood request's."""
    arguments = sample["arguments"]
    if isinstance(arguments, dict):  # lm_eval's .jsonl: {"gen_args_0": {"arg_0": prompt, "arg_1": options}}
        arguments = [list(request.values()) for request in arguments.values()]
    prompt, options = arguments[0][:2]
    if not isinstance(options, dict):  # (context, continuation): scored, not generated
        return None
    response = sample["filtered_resps"][0]
    response = response[0] if isinstance(response, list) else response
    target = sample["target"]
    reference = target if isinstance(target, str) else "\n".join(map(str, target))
    return Sample(task, int(sample["doc_id"]), prompt, str(response), reference)


def _logged_tasks(path: Path) -> dict[str, list[dict]]:
    """{task: its logged samples} of one `megadiff lm-eval --output` JSON or lm_eval .jsonl file."""
    if not path.is_file():
        raise ConfigError(f"no samples file {path}")
    try:
        if path.suffix == ".jsonl":
            match = SAMPLES_FILE.search(path.name)
            if match is None:
                raise ConfigError(f"{path}: lm_eval names its sample logs samples_TASK_DATE.jsonl")
            return {match["task"]: [json.loads(line) for line in lines_of(path) if line.strip()]}
        tasks = json.loads(path.read_text(encoding="utf-8")).get("samples")
    except (json.JSONDecodeError, AttributeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path} is not a harness sample log: {error}") from None
    if tasks and not isinstance(tasks, dict):
        raise ConfigError(f"{path} is not a harness sample log: its samples are no mapping of tasks to samples")
    if not tasks:
        raise ConfigError(f"{path} holds no samples: run `megadiff lm-eval ... --log-samples --output {path}`")
    return tasks


def read_samples(paths: Sequence[str | Path]) -> list[Sample]:
    """The generation samples of `megadiff lm-eval --output` JSON files and lm_eval's
    samples_TASK_DATE.jsonl files: one model's outputs, each task in one file."""
    sources: dict[str, Path] = {}
    samples: list[Sample] = []
    for path in map(Path, paths):
        for task, logged in _logged_tasks(path).items():
            if task in sources:
                raise ConfigError(f"task {task} is logged in {sources[task]} and in {path}: judge one model's "
                                  "outputs at a time")
            sources[task] = path
            try:
                samples += [sample for sample in map(partial(_generation, task), logged) if sample]
            except (KeyError, IndexError, TypeError, ValueError) as error:
                raise ConfigError(f"{path}: a {task} sample is not a harness sample log entry: {error!r}") from error
    if not samples:
        raise ConfigError(f"{[str(p) for p in paths]} hold no generated outputs (only scored requests)")
    return samples


def parse_verdict(judgment: str) -> bool | None:
    """The judgment's last "Verdict: yes/no"; None when it gives none."""
    verdicts = VERDICT.findall(judgment)
    return verdicts[-1].lower() == "yes" if verdicts else None


class ChatJudge:
    """A judge model behind an OpenAI-compatible /chat/completions endpoint, asked at temperature 0."""

    def __init__(self, url: str, model: str, api_key: str | None = None):
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--judge-url must be an http(s) URL (e.g. https://api.openai.com/v1), got {url!r}")
        self.endpoint = url.rstrip("/") + "/chat/completions"
        self.model, self.api_key = model, api_key

    def __call__(self, content: str) -> str:
        body = json.dumps({"model": self.model, "temperature": 0,
                           "messages": [{"role": "user", "content": content}]}).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        attempt = 0
        while True:
            try:
                request = urllib.request.Request(self.endpoint, data=body, headers=headers)
                with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as reply:
                    return self._judgment(reply.read())
            except urllib.error.HTTPError as error:
                if error.code not in RETRIED_STATUS or attempt == RETRIES:
                    raise JudgeError(f"the judge at {self.endpoint} answered {error.code}: "
                                     f"{error.read()[:300].decode(errors='replace')}") from error
            except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
                if attempt == RETRIES:
                    raise JudgeError(f"the judge at {self.endpoint} cannot be reached: {error}") from error
            time.sleep(RETRY_BACKOFF_S * 2 ** attempt)
            attempt += 1

    def _judgment(self, reply: bytes) -> str:
        """The reply's message; "" (no verdict) when the judge declined to write one (content null, as
        servers answer a refusal)."""
        try:
            content = json.loads(reply)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError) as error:
            raise JudgeError(f"the judge at {self.endpoint} sent no chat completion ({error!r}): "
                             f"{reply[:300].decode(errors='replace')}") from None
        if content is not None and not isinstance(content, str):
            raise JudgeError(f"the judge at {self.endpoint} sent a message that is not text: {content!r:.300}")
        return content or ""


def judge_samples(samples: Sequence[Sample], judge: Callable[[str], str], judge_model: str, records_path: Path,
                  workers: int, console: Console) -> dict[str, dict]:
    """Every sample's verdict record, asking the judge only for those `records_path` lacks and
    appending each new one there as it arrives."""
    if records_path.is_dir():
        raise ConfigError(f"--records {records_path} is a directory: name the file the verdicts are kept in")
    with utf8_input(f"--records {records_path}"):
        read = read_records(records_path)
    if any(not isinstance(record, dict) or "key" not in record for record in read):
        raise ConfigError(f"--records {records_path} holds lines that are no verdict records: name another file "
                          "(the samples are not read from it)")
    records = {record["key"]: record for record in read}
    todo = [sample for sample in samples if sample.key(judge_model) not in records]
    console.print(f"hallucination: {len(samples) - len(todo)} of {len(samples)} outputs already judged "
                  f"({records_path}), {len(todo)} to ask {judge_model}")
    progress = progress_bars(TextColumn("judging"), BarColumn(), MofNCompleteColumn(), TextColumn("eta"),
                             TimeRemainingColumn(), console=Console(stderr=True))
    with progress, ThreadPoolExecutor(max_workers=workers) as pool:
        bar = progress.add_task("", total=len(todo))
        asked = {pool.submit(judge, JUDGE_INSTRUCTIONS.format(prompt=sample.prompt, reference=sample.reference,
                                                              response=sample.response)): sample for sample in todo}
        try:
            failure = _keep_verdicts(asked, judge_model, records_path, records, lambda: progress.advance(bar))
        except BaseException:  # interrupted (Ctrl-C): the queued requests are not sent
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        if failure is not None:
            raise failure
    return records


def _keep_verdicts(asked: dict[Future, Sample], judge_model: str, records_path: Path, records: dict[str, dict],
                   advance: Callable[[], None]) -> BaseException | None:
    """Records every verdict as it arrives; after a request fails for good, those still queued
    are cancelled but the ones in flight are still kept. Returns the first failure."""
    failure = None
    for done in as_completed(asked):
        try:
            judgment = done.result()
        except CancelledError:
            continue
        except Exception as error:  # noqa: BLE001 -- the caller raises it once the verdicts in flight are kept
            if failure is None:
                failure = error
                for future in asked:
                    future.cancel()
            continue
        sample = asked[done]
        record = {"key": sample.key(judge_model), "task": sample.task, "doc_id": sample.doc_id,
                  "judge_model": judge_model, "accurate": parse_verdict(judgment), "judgment": judgment}
        append_record(records_path, record)
        records[record["key"]] = record
        advance()
    return failure


def summarize(samples: Sequence[Sample], records: dict[str, dict], judge_model: str) -> dict[str, dict]:
    """Per task: outputs, the judge's verdicts, and accuracy (the share free of hallucination)
    over the outputs it gave a verdict on."""
    report: dict[str, dict] = {}
    for sample in samples:
        verdict = records[sample.key(judge_model)]["accurate"]
        row = report.setdefault(sample.task, {"outputs": 0, "accurate": 0, "no_verdict": 0})
        row["outputs"] += 1
        row["accurate"] += verdict is True
        row["no_verdict"] += verdict is None
    for row in report.values():
        judged = row["outputs"] - row["no_verdict"]
        row["accuracy"] = row["accurate"] / judged if judged else float("nan")
    return report


def hallucination_cli(samples: Sequence[str], judge_url: str, judge_model: str, api_key_env: str = "OPENAI_API_KEY",
                      workers: int = 4, records: str | None = None, output: str | None = None) -> int:
    """`megadiff hallucination SAMPLES... --judge-url URL --judge-model NAME`: the judge's accuracy
    per task (printed; JSON with `output`)."""
    if workers < 1:
        raise ConfigError("--workers must be >= 1")
    judge = ChatJudge(judge_url, judge_model, os.environ.get(api_key_env))
    outputs = read_samples(samples)
    records_path = Path(records) if records else Path(samples[0]).with_suffix(".judgments.jsonl")
    if any(records_path.exists() and records_path.samefile(path) for path in samples):
        raise ConfigError(f"--records {records_path} is a samples file: the verdicts would be appended to it")
    console = command_console()
    report = summarize(outputs, judge_samples(outputs, judge, judge_model, records_path, workers, console),
                       judge_model)
    table = Table(title=f"free of hallucination, judged by {judge_model}")
    for column in ("task", "outputs", "accuracy", "no verdict"):
        table.add_column(column, justify="left" if column == "task" else "right")
    for task, row in report.items():
        table.add_row(task, str(row["outputs"]), f"{row['accuracy']:.3f}", str(row["no_verdict"]))
    console.print(table)
    write_report(console, {"judge_model": judge_model, "judge_url": judge_url, "samples": [str(s) for s in samples],
                           "tasks": report}, output)
    return 0
