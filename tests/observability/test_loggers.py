"""Experiment trackers (``Trainer(loggers=[...])``, ``trainer: {loggers: [...]}``): each
logger gets the run's config, every metric line's numbers, sample rollouts after a validation
(W&B's table), the summary, and is closed whatever the run's end. Read back with the real
packages, offline: W&B's offline run file, an MLflow file store, TensorBoard event files. The
trackers run on their own thread: one that blocks never holds up the run, a full queue drops
lines, one that raises is turned off alone."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import signal
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar, Literal

import psutil
import pytest
import yaml
from fake_openai_backend import FakeBackend, reply_text
from helpers import tensorboard_events

import voltrl as vl
from voltrl.cli import build_from_config, main
from voltrl.observability.metrics import read_metrics
from voltrl.observability.trackers import (
    Logger,
    MlflowLogger,
    RolloutRow,
    Trackers,
    WandbLogger,
    numeric,
    parse_loggers,
)


@pytest.fixture(autouse=True)
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """W&B offline, quiet, its files in tmp_path; no MLflow server; no service left over."""
    for var, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_CONSOLE": "off",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_DISABLE_CODE": "true",
        "WANDB_X_DISABLE_STATS": "true",
        "WANDB_DIR": str(tmp_path / "wandb-dir"),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "MLFLOW_ALLOW_FILE_STORE": "set, then unset: the logger sets it for a file store",
    }.items():
        monkeypatch.setenv(var, value)
    for var in ("WANDB_API_KEY", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "wandb-dir").mkdir()
    yield
    if (wandb := sys.modules.get("wandb")) is not None:  # None: a test hid it
        wandb.teardown()
    services = [p for p in psutil.Process().children(recursive=True) if "wandb" in p.name()]
    assert not services, f"W&B service processes left running: {services}"


def scripted(task: dict, resources: Any) -> float:
    """A model-free agent: the reward is in the task."""
    return float(task["reward"])


@vl.rollout
async def asks_the_model(task: dict, llm: vl.LLM) -> float:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": task["question"]}]
    )
    return 1.0 if reply.choices[0].message.content == reply_text(0) else 0.0


class Recorder(Logger):
    """A logger of one's own: records each hook call (in ``calls``, shared by its copies)."""

    name: Literal["recorder"] = "recorder"
    calls: ClassVar[list[tuple[str, Any]]] = []

    def start(self, run: vl.Run, run_dir: Path, config: Any) -> None:
        self.calls.append(("start", config))

    def log_metrics(self, step: int, metrics: Any) -> None:
        self.calls.append(("log_metrics", (step, dict(metrics))))

    def finish(self, summary: Any) -> None:
        self.calls.append(("finish", dict(summary)))

    def close(self) -> None:
        self.calls.append(("close", None))


class Blocking(Logger):
    """A tracker whose ``log_metrics`` sets ``entered`` and waits until the test sets
    ``release``, then records the line in ``received``. On the event loop's thread (the main
    one) it would wait forever, the test being unable to release it: it raises there instead."""

    name: Literal["blocking"] = "blocking"
    entered: ClassVar[threading.Event] = threading.Event()
    release: ClassVar[threading.Event] = threading.Event()
    closed: ClassVar[threading.Event] = threading.Event()
    received: ClassVar[list[tuple[int, dict[str, float]]]] = []

    def log_metrics(self, step: int, metrics: Any) -> None:
        if threading.current_thread() is threading.main_thread():
            raise RuntimeError("log_metrics on the event loop's thread: it would wait forever")
        self.entered.set()
        self.release.wait()
        self.received.append((step, dict(metrics)))

    def close(self) -> None:
        self.closed.set()


@pytest.fixture
def blocking() -> Iterator[None]:
    """A fresh :class:`Blocking`, released at the end whatever happened."""
    Blocking.entered.clear()
    Blocking.release.clear()
    Blocking.closed.clear()
    Blocking.received.clear()
    yield
    Blocking.release.set()  # never leave the trackers' thread waiting


class Raises(Logger):
    """A tracker whose hook ``fails_in`` raises (each time); ``calls`` lists the hooks called."""

    name: Literal["raises"] = "raises"
    fails_in: str
    calls: ClassVar[list[str]] = []

    def start(self, run: vl.Run, run_dir: Path, config: Any) -> None:
        self._called("start")

    def log_metrics(self, step: int, metrics: Any) -> None:
        self._called("log_metrics")

    def finish(self, summary: Any) -> None:
        self._called("finish")

    def close(self) -> None:
        self.calls.append("close")

    def _called(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.fails_in:
            raise ConnectionError("the tracking server is gone")


def metric_lines(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """The lines of a run's ``metrics.jsonl`` as a tracker gets them: step and numbers."""
    ids = ("run_id", "step", "time")
    records = read_metrics(run_dir / "metrics.jsonl")
    return [(r["step"], numeric({k: v for k, v in r.items() if k not in ids})) for r in records]


# ---- reading back what each tracker wrote -------------------------------------------------


def wandb_records(run_dir: Path) -> dict[str, list[Any]]:
    """The records of an offline W&B run file (``run-ID.wandb``: LevelDB-log framing, 32 KiB
    blocks of ``crc32, length, type`` chunks after a 7-byte header) by record type."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(str(run_dir / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    out: dict[str, list[Any]] = {}
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record.FromString(pending)
            pending = b""
            field = record.WhichOneof("record_type")
            out.setdefault(field, []).append(getattr(record, field))
    return out


def wandb_items(records: list[Any], attribute: str) -> list[dict[str, Any]]:
    """Each history/summary/config record's items as ``{key: value}``."""
    rows = []
    for record in records:
        items = getattr(record, attribute)
        rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in items})
    return rows


def tensorboard_text(events: Any, tag: str) -> str:
    [event] = events.Tensors(tag)
    return event.tensor_proto.string_val[0].decode()


def mlflow_run(uri: str) -> Any:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    [run] = client.search_runs([client.get_experiment_by_name("voltrl").experiment_id])
    return client, run


# ---- the tests ----------------------------------------------------------------------------


@pytest.mark.slow
async def test_a_fit_reaches_every_tracker(tmp_path: Path) -> None:
    """Trainer.fit with all three (and jsonl): config, metrics, the validation's rollouts
    with the model's reply (W&B), summary; each read back from the package's own files."""
    uri = (tmp_path / "mlruns").as_uri()
    loggers = [
        "jsonl",
        "tensorboard",
        {"name": "wandb", "project": "voltrl-tests", "rollouts": 2},
        {"name": "mlflow", "tracking_uri": uri},
    ]
    train = [{"question": "q1"}, {"question": "q2"}]
    async with FakeBackend() as backend:
        trainer = vl.Trainer(
            resources={"main_llm": vl.LLM(endpoint=backend.url, model="m")},
            run_dir=tmp_path / "runs",
            name="tracked",
            inline=True,
            progress=False,
            loggers=loggers,
        )
        result = await trainer.fit_async(asks_the_model, train, [{"question": "v"}] * 3)
    assert result.run.status == "finished" and result.stats.reward_mean == 1.0
    lines = (result.run_dir / "metrics.jsonl").read_text().splitlines()  # jsonl: as before
    assert [sorted(json.loads(line))[:2] for line in lines] == [["run_id", "step"]] * 2
    assert os.environ["MLFLOW_ALLOW_FILE_STORE"] == "true"

    events = tensorboard_events(result.run_dir / "tensorboard")
    assert [e.value for e in events.Scalars("train/reward_mean")] == [1.0]
    assert [e.value for e in events.Scalars("val/rollouts")] == [3.0]
    assert [e.value for e in events.Scalars("summary/val/rollouts")] == [3.0]
    assert "train/reward_std" in events.Tags()["scalars"]  # numbers only: no None
    assert '"name": "baseline"' in tensorboard_text(events, "config")
    assert '"summary/status": "finished"' in tensorboard_text(events, "summary")

    client, run = mlflow_run(uri)
    assert run.info.run_name == "tracked" and run.info.status == "FINISHED"
    assert run.data.params["algorithm.name"] == "baseline"
    assert run.data.params["trainer.max_attempts"] == "3"
    assert run.data.tags["voltrl.run_id"] == result.run.run_id
    assert run.data.tags["summary/status"] == "finished"
    history = client.get_metric_history(run.info.run_id, "val/reward_mean")
    assert [(m.step, m.value) for m in history] == [(0, 1.0)]
    assert run.data.metrics["summary/train/rollouts"] == 2.0

    [wandb_run] = glob.glob(str(tmp_path / "wandb-dir" / "wandb" / "offline-run-*"))
    records = wandb_records(Path(wandb_run))
    assert records["run"][0].display_name == "tracked"
    assert records["run"][0].project == "voltrl-tests"
    config = {i.key: json.loads(i.value_json) for i in records["run"][0].config.update}
    assert config["algorithm"]["name"] == "baseline" and config["run"]["kind"] == "fit"
    history_rows = wandb_items(records["history"], "item")
    assert {"train/reward_mean": 1.0, "step": 0}.items() <= history_rows[0].items()
    assert {"val/reward_mean": 1.0, "step": 0}.items() <= history_rows[1].items()
    summary = {k: v for row in wandb_items(records["summary"], "update") for k, v in row.items()}
    assert summary["summary/status"] == "finished" and summary["summary/val/rollouts"] == 3
    assert records["exit"][0].exit_code == 0
    [table_file] = glob.glob(f"{wandb_run}/files/media/table/val/rollouts_*.table.json")
    table = json.loads(Path(table_file).read_text())
    assert table["columns"] == ["step", *RolloutRow.model_fields]
    rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    assert len(rows) == 2  # rollouts=2 of the 3
    assert {(r["input"], r["reward"], r["response"]) for r in rows} == {
        ('{"question": "v"}', 1.0, reply_text(0))
    }


def test_the_yaml_config_chooses_loggers_and_train_yaml_keeps_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``voltrl train`` with ``trainer: {loggers: [...]}``; the run's ``train.yaml`` names the
    same loggers, and runs with them again."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"reward": r}) + "\n" for r in (0.0, 1.0)))
    uri = (tmp_path / "mlruns").as_uri()
    loggers = [
        "jsonl",
        {"name": "tensorboard", "log_dir": str(tmp_path / "tb")},
        {"name": "mlflow", "tracking_uri": uri, "experiment": "voltrl"},
    ]
    config = {
        "agent": f"{Path(__file__).resolve()}:scripted",
        "data": {"train": str(data), "val": str(data)},
        "algorithm": {"name": "baseline"},
        "trainer": {
            "run_dir": str(tmp_path / "runs"),
            "name": "yaml",
            "inline": True,
            "progress": False,
            "loggers": loggers,
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0

    events = tensorboard_events(tmp_path / "tb")
    assert [e.value for e in events.Scalars("train/reward_mean")] == [0.5]
    client, run = mlflow_run(uri)
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "val/rollouts")
    assert [m.value for m in history] == [2.0]

    written = yaml.safe_load((tmp_path / "runs" / "yaml" / "train.yaml").read_text())
    assert written["trainer"]["loggers"] == [
        {"name": "tensorboard", "log_dir": str(tmp_path / "tb")},
        {"name": "mlflow", "tracking_uri": uri},
    ]
    again, *_ = build_from_config(written)
    assert again.loggers == parse_loggers(loggers)

    config["trainer"]["loggers"] = ["tensorboard", "neptune"]
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 2
    assert "unknown logger 'neptune': choose from jsonl, tensorboard, wandb, mlflow" in (
        capsys.readouterr().err
    )


def test_loggers_get_the_summary_and_are_closed_when_a_run_fails(tmp_path: Path) -> None:
    Recorder.calls.clear()
    uri = (tmp_path / "mlruns").as_uri()

    def fails(task: dict, resources: Any) -> float:
        raise RuntimeError("agent bug")

    trainer = vl.Trainer(
        run_dir=tmp_path,
        name="bad",
        inline=True,
        progress=False,
        loggers=[Recorder(), {"name": "mlflow", "tracking_uri": uri}],
    )
    with pytest.raises(vl.TooManyFailuresError):
        trainer.fit(fails, [{"reward": 1}])
    assert [name for name, _ in Recorder.calls] == ["start", "finish", "close"]
    summary = Recorder.calls[1][1]
    assert summary["summary/status"] == "failed"
    assert "TooManyFailuresError" in summary["summary/error"]
    assert summary["summary/train/failed"] == 1.0
    _client, run = mlflow_run(uri)
    assert run.info.status == "FAILED" and run.data.tags["summary/status"] == "failed"
    written = yaml.safe_load((tmp_path / "bad" / "train.yaml").read_text())
    assert written["trainer"]["loggers"] == [{"name": "mlflow", "tracking_uri": uri}]  # not ours


@pytest.mark.slow
def test_ctrl_c_ends_the_loggers_too(tmp_path: Path) -> None:
    """SIGINT during a run (the trainer's Ctrl-C): the loggers still get the summary
    (``interrupted``) and are closed; W&B's run ends with exit code 1."""
    Recorder.calls.clear()

    async def presses_ctrl_c(task: dict, resources: Any) -> float:
        os.kill(os.getpid(), signal.SIGINT)
        await asyncio.sleep(60)
        return 1.0

    trainer = vl.Trainer(
        run_dir=tmp_path, name="c", inline=True, progress=False, loggers=[Recorder(), "wandb"]
    )
    with pytest.raises(KeyboardInterrupt):
        trainer.fit(presses_ctrl_c, [{"reward": 1}])
    assert [name for name, _ in Recorder.calls] == ["start", "finish", "close"]
    assert Recorder.calls[1][1]["summary/status"] == "interrupted"
    [wandb_run] = glob.glob(str(tmp_path / "wandb-dir" / "wandb" / "offline-run-*"))
    assert wandb_records(Path(wandb_run))["exit"][0].exit_code == 1


def test_only_numbers_reach_the_loggers(tmp_path: Path) -> None:
    Recorder.calls.clear()

    class Logs(vl.Algorithm):
        name = "logs"

        async def train(self, ctx: vl.TrainContext, train: Any, val: Any) -> None:
            ctx.log(3, loss=0.5, tokens=7, lr=None, note="text", done=True, nested={"a": 1})

    vl.Trainer(Logs(), run_dir=tmp_path, inline=True, progress=False, loggers=[Recorder()]).fit(
        scripted, [{"reward": 1}]
    )
    logged = [args for name, args in Recorder.calls if name == "log_metrics"]
    assert logged == [(3, {"loss": 0.5, "tokens": 7.0, "done": 1.0})]
    assert numeric({"a": 1, "b": "x", "c": None, "d": 1e400}) == {"a": 1.0, "d": float("inf")}


def test_an_unknown_name_or_option_says_what_is_valid() -> None:
    with pytest.raises(vl.VoltRLError, match="unknown logger 'neptune': choose from jsonl, "):
        vl.Trainer(loggers=["tensorboard", "neptune"])
    with pytest.raises(vl.VoltRLError, match="logger 'wandb': projetc: Extra inputs"):
        vl.Trainer(loggers=[{"name": "wandb", "projetc": "x"}])
    with pytest.raises(vl.VoltRLError, match="logger 'wandb': mode: Input should be"):
        vl.Trainer(loggers=[{"name": "wandb", "mode": "offlne"}])
    with pytest.raises(vl.VoltRLError, match=r"loggers \['mlflow'\] given more than once"):
        vl.Trainer(loggers=["mlflow", MlflowLogger()])
    with pytest.raises(vl.VoltRLError, match="unknown logger None"):
        vl.Trainer(loggers=[{"project": "x"}])
    with pytest.raises(vl.VoltRLError, match="logger 'jsonl' takes no options"):
        vl.Trainer(loggers=[{"name": "jsonl", "path": "x"}])
    with pytest.raises(vl.VoltRLError, match="a logger is a name, a mapping"):
        vl.Trainer(loggers=[42])
    assert vl.Trainer(loggers="jsonl").loggers == vl.Trainer().loggers == []
    assert vl.Trainer(loggers="wandb").loggers == [WandbLogger()]


@pytest.mark.parametrize(
    ("name", "module"), [("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow")]
)
def test_a_missing_package_names_the_extra_to_install(
    name: str, module: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chosen = parse_loggers([name])  # while the package is there
    for mod in [m for m in sys.modules if m == module or m.startswith(f"{module}.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails
    needs = rf"logger '{name}' needs the '{name}' extra .*pip install 'voltrl\[{name}\]'"
    with pytest.raises(vl.VoltRLError, match=needs):
        vl.Trainer(loggers=[name])
    run = vl.Run(name="r", kind="fit")
    with pytest.raises(vl.VoltRLError, match=needs):  # at start too (a broken install, say)
        chosen[0].start(run, tmp_path, {})


@pytest.mark.usefixtures("blocking")
def test_a_tracker_that_blocks_never_holds_up_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run finishes while its tracker still waits in its first ``log_metrics`` (the loop only
    queued the lines; with ``close_timeout_s=0`` the end does not wait for them either) and says
    how many lines were not delivered, naming the call it waits in; released, the tracker gets
    every line, then its close."""
    monkeypatch.setattr(Trackers, "close_timeout_s", 0.0)
    close = Trackers.close

    async def close_once_blocked(self: Trackers) -> None:
        # the run may end before the trackers' thread reaches the first line: wait till it has
        entered = await asyncio.to_thread(Blocking.entered.wait, 60)
        assert entered, "the tracker never reached its first log_metrics"
        await close(self)

    monkeypatch.setattr(Trackers, "close", close_once_blocked)
    trainer = vl.Trainer(
        run_dir=tmp_path, name="slow", inline=True, progress=False, loggers=[Blocking()]
    )
    result = trainer.fit(scripted, [{"reward": 1}], [{"reward": 0}])
    assert result.run.status == "finished"
    assert Blocking.received == []  # still waiting on the first line
    lines = metric_lines(result.run_dir)
    assert len(lines) == 2  # train, val
    assert (
        "warning: trackers: 2 lines not delivered after 0 s ('blocking' log_metrics still running"
        in capsys.readouterr().err
    )
    Blocking.release.set()
    assert Blocking.closed.wait(60)  # a bound only so that a broken build fails, not hangs
    assert Blocking.received == lines


@pytest.mark.usefixtures("blocking")
async def test_a_full_queue_drops_and_counts_lines_instead_of_waiting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With room for two lines and the tracker stuck in the first, the next is queued and the
    three after it are dropped at once, counted, and reported: once as it happens, then the
    count when the trackers close. The lines kept arrive in order once the tracker goes on."""
    trackers = Trackers([Blocking()], max_queued=2)
    trackers.start(vl.Run(name="r", kind="fit"), tmp_path, {})
    for step in range(5):
        trackers.log_metrics(step, {"x": step})
    assert trackers.dropped == 3
    err = capsys.readouterr().err
    assert err.count("warning: trackers: 2 lines wait") == 1 and err.endswith("dropping lines\n")
    Blocking.release.set()
    await trackers.close()
    assert Blocking.received == [(0, {"x": 0.0}), (1, {"x": 1.0})]
    assert capsys.readouterr().err == "warning: trackers: 3 lines dropped (the queue was full)\n"


@pytest.mark.parametrize(
    ("fails_in", "calls"),
    [("start", ["start", "close"]), ("log_metrics", ["start", "log_metrics", "close"])],
)
def test_a_tracker_that_raises_is_reported_once_and_the_others_get_every_line(
    fails_in: str, calls: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tracker whose start or log_metrics raises gets one warning line and nothing more but
    its close; the run finishes and the other tracker gets every line, the summary and close."""
    Recorder.calls.clear()
    Raises.calls.clear()
    trainer = vl.Trainer(
        run_dir=tmp_path,
        name="r",
        inline=True,
        progress=False,
        loggers=[Raises(fails_in=fails_in), Recorder()],
    )
    result = trainer.fit(scripted, [{"reward": 1}], [{"reward": 0}])
    assert result.run.status == "finished"
    assert Raises.calls == calls
    lines = metric_lines(result.run_dir)
    assert len(lines) == 2
    assert [args for name, args in Recorder.calls if name == "log_metrics"] == lines
    hooks = [name for name, _ in Recorder.calls]
    assert hooks == ["start", "log_metrics", "log_metrics", "finish", "close"]
    reported = [line for line in capsys.readouterr().err.splitlines() if "'raises'" in line]
    assert reported == [
        f"warning: tracker 'raises' is off for the rest of the run: its {fails_in} raised "
        "ConnectionError: the tracking server is gone"
    ]
