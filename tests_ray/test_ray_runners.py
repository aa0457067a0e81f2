"""Runner workers as Ray actors (``Trainer(runners=vl.RayRunners(...))``) on a Ray cluster of
three nodes simulated on this machine (below): LocalRL trains through actors
spread over the nodes; a node removed mid-step loses no rollout and trains none twice; Ctrl-C
leaves no actor alive; an agent whose module only ``runtime_env`` brings runs, and without it
fails in one line naming the node and the import; the number of runners follows the work.

The cluster (Ray's own ``ray.cluster_utils.Cluster``, as Ray's tests use it): three nodes (the
head and two workers; a fourth is added and removed by one test) of 2 CPUs, each with 2 of the
custom resource ``agents``. It lives for this module (about 10 s to start); each
test connects to it (``ray_cluster``) and disconnects at its end, so a test elsewhere that
starts a Ray of its own finds none. These tests run in ``.venv-verl``, which has Ray, beside
``tests_verl/`` (whose ``conftest`` module name they leave alone: no conftest here).

The agents here are pickled by value (``register_pickle_by_value``): the nodes of a cluster
this process joined get no ``sys.path`` of ours, so a test module is not importable there.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest
from openai import AsyncOpenAI

import voltrl as vl
from voltrl.store.memory import InMemoryStore

cloudpickle.register_pickle_by_value(sys.modules[__name__])
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    from ray.cluster_utils import Cluster

    # the dashboard (which the state API asks) on a free port: not Ray's 8265, which another
    # Ray on this machine may hold
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    node = {"num_cpus": 2, "resources": {"agents": 2}}
    head = {**node, "include_dashboard": True, "dashboard_port": port}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        # a plain ray.init elsewhere (VERL's) starts a Ray of its own, not this one
        from ray._common.utils import reset_ray_address

        reset_ray_address()
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture
def ray_cluster(cluster) -> Iterator[object]:
    """The module's cluster, this process connected to it for the test."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()


pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROWS = [{"letter": c} for c in "abc"]


@vl.rollout
async def say_letter(task: dict, llm: vl.LLM) -> float:
    """One chat call, then ``hold`` seconds of work (1 by default): reward 1 when the reply
    holds the letter."""
    client = AsyncOpenAI(base_url=llm.endpoint, api_key=llm.api_key, max_retries=0)
    reply = await client.chat.completions.create(
        model=llm.model,
        messages=[{"role": "user", "content": f"Say {task['letter']}."}],
        **llm.sampling_parameters,
    )
    await asyncio.sleep(task.get("hold", 1.0))
    return float(task["letter"] in (reply.choices[0].message.content or ""))


@vl.rollout
async def sleeper(task: dict, resources: vl.Resources) -> float:
    await asyncio.sleep(0.5)
    return 1.0


def local_rl(steps: int = 2) -> vl.LocalRL:
    from voltrl.models.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    return vl.LocalRL(
        build_tiny_model(tok, seed=0),
        tokenizer=tok,
        schedule={"steps": steps, "tasks_per_step": 3, "group_size": 2},
        sampling={"temperature": 1.0, "max_tokens": 6},
        seed=0,
    )


def runner_actors(job_id: str | None = None, state: str | None = None) -> list:
    """The cluster's runner actors (Ray's state API), of one job and in one state if given."""
    from ray.util.state import list_actors

    filters = [("class_name", "=", "RunnerActor")]
    filters += [("job_id", "=", job_id)] if job_id else []
    filters += [("state", "=", state)] if state else []
    return list_actors(filters=filters, limit=1000, raise_on_missing_output=False)


async def attempts_of(store, rollouts) -> list:
    return [a for r in rollouts for a in await store.get_attempts(r.rollout_id)]


async def test_local_rl_runs_every_rollout_on_ray_actors_spread_over_the_nodes(
    ray_cluster, tmp_path, capsys
):
    import ray

    store = InMemoryStore()
    runners = vl.RayRunners(n=3, resources={"agents": 1})
    trainer = vl.Trainer(local_rl(), runners=runners, store=store, run_dir=tmp_path, progress=False)
    result = await trainer.fit_async(say_letter, ROWS)
    assert result.run.status == "finished"
    train = [r for r in result.rollouts if r.mode == "train"]
    assert len(train) == 2 * 3 * 2 and all(r.status == "succeeded" for r in train)
    # the actors of this run: one on each worker node, as SPREAD places them
    actors = runner_actors(ray.get_runtime_context().get_job_id())
    assert len(actors) == 3
    assert len({a.node_id for a in actors}) == 3
    # every attempt ran on one of them: its worker id names the actor's node
    nodes = {a.node_id[:8] for a in actors}
    for attempt in await attempts_of(store, result.rollouts):
        name, _, node = attempt.worker_id.partition("@")
        assert name.startswith("ray-") and node in nodes
    # the runners reached the run at the address Ray knows this machine by (the trainer
    # joined this cluster: its nodes may be other machines), not at loopback
    out = capsys.readouterr().out
    assert f"they reach this run at http://{ray.util.get_node_ip_address()}:" in out
    assert "http://127.0.0.1:" not in out
    deadline = time.monotonic() + 30  # the run's end killed them (Ray marks them soon after)
    while runner_actors(ray.get_runtime_context().get_job_id(), state="ALIVE"):
        assert time.monotonic() < deadline, "runner actors alive after the run"
        time.sleep(0.2)


@pytest.fixture
def fourth_node(ray_cluster) -> Iterator[tuple[object, str]]:
    """A fourth worker node (and its node id's first 8 characters), removed at the end if the
    test did not remove it: the module's later tests get the three nodes."""
    import ray

    node = ray_cluster.add_node(num_cpus=2, resources={"agents": 2, "doomed": 1})
    ray_cluster.wait_for_nodes()
    node_id = next(
        n["NodeID"][:8] for n in ray.nodes() if n["Alive"] and "doomed" in n["Resources"]
    )
    try:
        yield node, node_id
    finally:
        if node in ray_cluster.worker_nodes:
            ray_cluster.remove_node(node)


async def test_a_node_removed_mid_step_loses_no_rollout_and_trains_none_twice(
    ray_cluster, fourth_node, tmp_path
):
    """The fourth node, removed while one of its runner's rollouts runs: Ray restarts that
    runner on another node, the attempt it held expires with its lease and is retried; every
    rollout succeeds exactly once and each step trains on each of its rollouts once."""

    doomed, doomed_id = fourth_node
    store = InMemoryStore()
    # one rollout a runner: the 6 of a step keep all four busy, the doomed node's too
    runners = vl.RayRunners(n=4, max_concurrency=1, resources={"agents": 1})
    trainer = vl.Trainer(
        local_rl(), runners=runners, store=store, run_dir=tmp_path, progress=False, lease_s=8.0
    )
    # 4 s of work a rollout: the attempt seen running is still running when its node goes
    rows = [{**row, "hold": 4.0} for row in ROWS]
    run = asyncio.create_task(trainer.fit_async(say_letter, rows))
    deadline = time.monotonic() + 120
    while not run.done():  # until an attempt runs on the doomed node
        running = await store.query_rollouts(status=["running"])
        attempts = await attempts_of(store, running)
        if any(a.worker_id.endswith(doomed_id) and a.status == "running" for a in attempts):
            break
        assert time.monotonic() < deadline, "no rollout ran on the fourth node"
        await asyncio.sleep(0.1)
    removed_at = time.monotonic()
    await asyncio.to_thread(ray_cluster.remove_node, doomed)
    result = await run
    assert result.run.status == "finished"
    train = [r for r in result.rollouts if r.mode == "train"]
    assert len(train) == 12 and all(r.status == "succeeded" for r in train)
    orphans = 0
    for r in train:
        attempts = await store.get_attempts(r.rollout_id)
        assert [a.status for a in attempts].count("succeeded") == 1
        assert attempts[-1].attempt_id == r.final_attempt_id
        if attempts[0].worker_id.endswith(doomed_id) and len(attempts) > 1:
            orphans += 1
            assert attempts[0].status in ("expired", "failed")
            assert not attempts[-1].worker_id.endswith(doomed_id)
    assert orphans >= 1, "the removed node held no attempt"
    # each step trained each of its 6 rollouts once: one row each, from its final attempt
    steps = [m for m in result.metrics if "batch/rollouts" in m]
    assert [(m["batch/rollouts"], m["batch/rows"]) for m in steps] == [(6, 6), (6, 6)]
    print(f"node removed: the run ended {time.monotonic() - removed_at:.1f} s later")


def test_ctrl_c_of_the_trainer_leaves_no_runner_actor_alive(cluster, tmp_path):
    import ray

    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import asyncio
            import voltrl as vl

            @vl.rollout
            async def slow(task, resources):
                await asyncio.sleep(30)
                return 1.0

            runners = vl.RayRunners(n=3, address={cluster.address!r})
            trainer = vl.Trainer(runners=runners, run_dir={str(tmp_path)!r}, progress=False)
            trainer.dev(slow, [{{"i": i}} for i in range(12)])
            """
        )
    )
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the runners are up
            if "they reach this run" in line:
                break
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 60
        while len(runner_actors(state="ALIVE")) < 3:
            assert time.monotonic() < deadline, "the runners did not start"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=60)[0]
        assert proc.returncode != 0 and "KeyboardInterrupt" in rest, rest
        assert "cancelled 12 unfinished rollouts" in rest and "interrupted" in rest
        deadline = time.monotonic() + 30
        while alive := runner_actors(state="ALIVE"):
            assert time.monotonic() < deadline, f"actors still alive: {alive}"
            time.sleep(0.2)
    finally:
        if proc.poll() is None:
            proc.kill()
        ray.shutdown()


AGENT_MODULE = '''
import voltrl as vl
from ray_project_tools import score

@vl.rollout
def project_agent(task, resources):
    """An agent of the user's project: it uses a module of the project, installed nowhere."""
    return score(task)
'''
TOOLS_MODULE = """
def score(task):
    return float(task["x"])
"""


async def test_an_agent_module_reaches_the_nodes_through_runtime_env_and_fails_in_a_line_without(
    cluster, tmp_path, monkeypatch
):
    """The trainer joins the cluster itself: Ray takes a local ``working_dir`` only as the
    job's ``runtime_env``, which ``ray.init`` sets."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "ray_project_agent.py").write_text(AGENT_MODULE)
    (project / "ray_project_tools.py").write_text(TOOLS_MODULE)
    monkeypatch.syspath_prepend(str(project))
    # the agent's function travels by value; the module it uses, by name: the nodes import it
    from ray_project_agent import project_agent

    rows = [{"x": 1}, {"x": 0}]
    runners = vl.RayRunners(n=2, address=cluster.address)
    trainer = vl.Trainer(runners=runners, run_dir=tmp_path / "runs", progress=False)
    with pytest.raises(vl.AgentLoadError) as raised:
        await trainer.dev_async(project_agent, rows)
    message = str(raised.value)
    assert "\n" not in message
    assert "cannot load the agent: ModuleNotFoundError: No module named 'ray_project_tools'" in (
        message
    )
    assert message.startswith("runner ray-") and " on node " in message
    assert "runtime_env" in message

    runners = vl.RayRunners(n=2, address=cluster.address, runtime_env={"working_dir": str(project)})
    trainer = vl.Trainer(runners=runners, run_dir=tmp_path / "runs", progress=False)
    result = await trainer.dev_async(project_agent, rows)
    assert result.rewards == [1.0, 0.0]


async def test_the_runners_follow_the_work_and_scale_between_steps(ray_cluster, tmp_path):
    """``n`` as a function of the unfinished rollouts: one runner for a small batch, three
    for a larger one; ``scale`` sets the number between steps too."""
    import ray

    from voltrl.algorithms.base import Algorithm

    seen: list[int] = []

    async def actors_reaching(n: int) -> int:
        """How many runner actors this run has asked Ray for (any state but dead), polled
        until it is ``n`` (Ray registers a new actor a moment after it is asked for) or 60 s
        have passed."""
        job = ray.get_runtime_context().get_job_id()
        deadline = time.monotonic() + 60
        while True:
            actors = await asyncio.to_thread(runner_actors, job)
            count = sum(a.state != "DEAD" for a in actors)
            if count == n or time.monotonic() > deadline:
                return count
            await asyncio.sleep(0.2)

    class TwoSteps(Algorithm):
        name = "two_steps"

        async def train(self, ctx, train, val):
            await ctx.run_rollouts(train[:1], mode="train")
            seen.append(await actors_reaching(1))
            await ctx.run_rollouts(train * 3, mode="train")
            seen.append(await actors_reaching(3))
            runners.scale(2)  # the newest leaves once its call ends
            await ctx.run_rollouts(train, mode="train")
            seen.append(await actors_reaching(2))

    runners = vl.RayRunners(n=lambda backlog: 1 if backlog <= 1 else 3)
    store = InMemoryStore()
    trainer = vl.Trainer(TwoSteps(), runners=runners, store=store, run_dir=tmp_path, progress=False)
    result = await trainer.fit_async(sleeper, [{"i": i} for i in range(4)])
    assert result.run.status == "finished" and len(result.rollouts) == 1 + 12 + 4
    assert seen == [1, 3, 2]  # one, three, then the newest left
    first = (await store.get_attempts(result.rollouts[0].rollout_id))[-1]
    assert first.worker_id.startswith("ray-0@")  # the first batch's one runner


TRAIN_AGENT = """
import voltrl as vl

def score(task):
    return float(task["x"])

@vl.rollout
def agent(task, resources):
    return score(task)
"""


def test_voltrl_train_runs_its_runners_on_the_cluster_given_by_ray_address(
    cluster, tmp_path, monkeypatch
):
    """``voltrl train CONFIG --ray-address ADDRESS``: the config's ``trainer.runners.ray``
    settings with that address, its ``runtime_env`` bringing the agent's file to the nodes
    (its helper ``score`` travels by name); the run's ``train.yaml`` records the settings."""
    import yaml

    from voltrl.cli import main

    (tmp_path / "ray_train_agent.py").write_text(TRAIN_AGENT)
    (tmp_path / "train.jsonl").write_text('{"x": 1}\n{"x": 0}\n{"x": 1}\n')
    config = {
        "agent": f"{tmp_path / 'ray_train_agent.py'}:agent",
        "data": {"train": str(tmp_path / "train.jsonl")},
        "algorithm": {"name": "baseline"},
        "trainer": {
            # the agent's file uses a helper of its own (by name): working_dir brings it
            "runners": {
                "ray": {"n": 2, "resources": {"agents": 1}, "runtime_env": {"working_dir": "."}}
            },
            "run_dir": str(tmp_path / "runs"),
            "name": "on-ray",
            "progress": False,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)  # the project's directory: working_dir "."
    assert main(["train", str(path), "--ray-address", cluster.address]) == 0
    recorded = yaml.safe_load((tmp_path / "runs" / "on-ray" / "train.yaml").read_text())
    ray = recorded["trainer"]["runners"]["ray"]
    assert ray["n"] == 2 and ray["address"] == cluster.address
    assert ray["resources"] == {"agents": 1}


def test_apo_finds_the_better_prompt_with_its_runners_on_a_ray_started_for_the_run(tmp_path):
    """No address and no Ray yet: a Ray of this machine is started for the run (not the
    module's cluster) and stopped after it; APO's search runs its rollouts on the actors,
    which reach the run at loopback. ``tests/algorithms/apo``'s scripted LLMs and agent."""
    import ray

    from voltrl.store.sql import SQLStore

    root = Path(__file__).resolve().parents[1]
    for where in (root / "tests", root / "tests" / "algorithms" / "apo"):
        sys.path.insert(0, str(where))
    from fake_openai_backend import FakeBackend
    from test_apo import GOOD, fit, optimizer_model

    async def search() -> vl.RunResult:
        async with FakeBackend() as optimizer:
            optimizer.script = optimizer_model(GOOD)
            ray_runners = {"runners": vl.RayRunners(n=2), "inline": False}
            return await fit(tmp_path, optimizer, trainer=ray_runners)

    assert not ray.is_initialized()
    result = asyncio.run(search())
    assert not ray.is_initialized()  # the run's Ray is stopped
    val = [r for r in result.rollouts if r.mode == "val"]
    assert val and max(r.reward for r in val) == 1.0  # the rewrite scored better
    store = SQLStore(tmp_path / "apo" / "store.sqlite")
    try:
        attempts = [
            a
            for r in result.rollouts
            if r.mode != "optimizer"
            for a in asyncio.run(store.get_attempts(r.rollout_id))
        ]
    finally:
        asyncio.run(store.close())
    assert attempts and all(a.worker_id.startswith("ray-") for a in attempts)
