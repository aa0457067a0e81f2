"""The dashboard at scale and its cost to a training run.

1. **Rollouts page on a big store.** A SQLite store with 100,000 rollouts and 1,000,000 LLM
   calls (10 per rollout, two agents), written with the store's own statements. The dashboard
   serves it on loopback; each kind of rollouts page (default, a status filter, sorted by
   reward, a reward range, text search, an agent filter, a deep page) is fetched repeatedly
   with a real HTTP client; p50 and p99 per kind. Target: p50 < 300 ms.
   An event filter (``termination=max_turns``: one rollout in five recorded it) is read
   rollout by rollout down the list: its page is timed too, and one that matches nothing
   (it reads the events of 1,000 rollouts, its cap, and says so).
2. **Cost to a run.** The same short LocalRL run (tests/dashboard_run.py) trains alternately
   with no dashboard and with a dashboard process whose pages are polled as an open browser
   polls them (the runs, run and rollouts pages every 3 s, the run's chart series every 3 s);
   the ratio of the medians of the run's wall time (pairs in alternating order). Target: < 5%
   slower.
3. **A rollout page of a long game.** A werewolf-sized run (tests/dashboard_game.py: 4 rounds
   of 200 calls, 2,500 prompt tokens each, the sample's spans and rewards): each rollout's
   page is weighed (bytes) and loaded in headless Chromium (navigation to the load event),
   first with the dashboard just started (cold: its records read and the conversation laid
   out), then again; then a call's token view is opened, as a reader clicks it. Target: under
   1 MB and 1 s.

    .venv/bin/python benchmarks/dashboard_bench.py            # all three (~8 minutes)
    .venv/bin/python benchmarks/dashboard_bench.py --part pages --rollouts 100000
    .venv/bin/python benchmarks/dashboard_bench.py --part rollout --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from voltrl._http.serving import serve_in_thread
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.store.sql import SQLStore
from voltrl.store.sql.statements import rollout_row
from voltrl.types import LLMCall, Rollout, Run, Span, Task

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # dashboard_game: the long game's store
ENDINGS = ["user_stop", "agent_stop", "max_turns", "agent_stop", "user_stop"]


def fill(path: Path, n_rollouts: int, calls_per: int) -> str:
    """A store with ``n_rollouts`` finished rollouts of one run and ``calls_per`` calls each;
    returns the run id."""
    store = SQLStore(path)
    run = asyncio.run(store.add_run(Run(name="big", kind="fit", algorithm="local_rl")))
    rng = random.Random(0)
    conn = store._db.connection()
    sql = store._sql
    t0 = time.time() - n_rollouts
    batch = 5000
    for start in range(0, n_rollouts, batch):
        rollouts, calls, spans = [], [], []
        for i in range(start, min(start + batch, n_rollouts)):
            status = "succeeded" if rng.random() > 0.03 else "failed"
            created = t0 + i
            r = Rollout(
                run_id=run.run_id,
                task=Task(task_id=f"task-{i // 8}", input={"question": f"what is {i} + {i % 97}?"}),
                mode="train" if i % 10 else "val",
                status=status,
                resources_version=1 + i // 64,
                attempt_count=1 + (rng.random() < 0.05),
                created_at=created,
                started_at=created + 0.1,
                finished_at=created + 0.2 + rng.random() * 5,
                reward=rng.choice([0.0, 0.0, 0.5, 1.0]) if status == "succeeded" else None,
            )
            rollouts.append(rollout_row(r, None))
            for k in range(calls_per):
                call = LLMCall(
                    rollout_id=r.rollout_id,
                    attempt_id="at-bench",
                    sequence_id=k,
                    agent_name="writer" if k % 2 == 0 else "checker",
                    request={"messages": [{"role": "user", "content": f"q{i}"}]},
                    response={"choices": [{"index": 0, "message": {"content": f"a{k}"}}]},
                    prompt_token_ids=list(range(40)),
                    response_token_ids=list(range(8)),
                    response_logprobs=[-0.5] * 8,
                    started_at=created,
                    ended_at=created + 0.05,
                )
                calls.append((r.rollout_id, "at-bench", k, call.model_dump_json()))
            episode = Span(
                rollout_id=r.rollout_id,
                attempt_id="at-bench",
                name="episode",
                start_time=created + 0.2,
                end_time=created + 0.2,
                attributes={"termination": ENDINGS[i % 5], "turns": 1 + i % 9},
                status="ok",
            )
            spans.append((r.rollout_id, "at-bench", calls_per, episode.model_dump_json()))
        with store._db.lock:
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(sql.insert_rollout, rollouts)
            conn.executemany(sql.insert_call, calls)
            conn.executemany(sql.insert_span, spans)
            conn.execute("COMMIT")
        print(f"\r  wrote {start + len(rollouts):,} rollouts", end="", flush=True)
    print()
    asyncio.run(store.close())
    return run.run_id


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_pages(n_rollouts: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "big" / "store.sqlite"
        started = time.time()
        run_id = fill(path, n_rollouts, 10)
        print(f"  filled in {time.time() - started:.0f} s ({path.stat().st_size / 1e9:.2f} GB)")
        pages = {
            "default (newest first)": f"/rollouts?run_id={run_id}",
            "status failed": f"/rollouts?run_id={run_id}&status=failed",
            "sorted by reward": f"/rollouts?run_id={run_id}&sort=reward",
            "reward in [0.5, 1]": f"/rollouts?run_id={run_id}&reward_min=0.5&reward_max=1",
            "text search": f"/rollouts?run_id={run_id}&text=what+is+4242",
            "agent filter": f"/rollouts?run_id={run_id}&agent=checker",
            "page 1000": f"/rollouts?run_id={run_id}&page=1000",
            "event termination": f"/rollouts?run_id={run_id}&event=termination%3Dmax_turns",
            "event, no match": f"/rollouts?run_id={run_id}&event=termination%3Dnever",
            "runs page": "/",
        }
        with (
            serve_in_thread(dashboard_app(Catalog([path]))) as server,
            httpx.Client(base_url=server.url, timeout=60) as client,
        ):
            print(f"\n  {'page':<24} {'p50 ms':>8} {'p99 ms':>8}  (n={repeats})")
            for name, url in pages.items():
                client.get(url).raise_for_status()  # warm the page cache
                times = []
                for _ in range(repeats):
                    t = time.perf_counter()
                    client.get(url).raise_for_status()
                    times.append((time.perf_counter() - t) * 1000)
                p50, p99 = pct(times, 0.5), pct(times, 0.99)
                flag = "" if p50 < 300 else "  (over 300 ms)"
                print(f"  {name:<24} {p50:8.1f} {p99:8.1f}{flag}")


def chromium() -> Any:
    """Headless Chromium through Selenium, as tests/observability/test_dashboard_browser.py
    drives it."""
    import shutil

    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or shutil.which("chromium-browser") or ""
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def load_s(driver: Any, url: str) -> tuple[float, float]:
    """Seconds from navigating to ``url`` to its load event, as Chromium timed them, and to
    its training rows being in the page (fetched once it has loaded)."""
    from selenium.webdriver.common.by import By

    driver.get(url)
    while not driver.find_elements(By.CSS_SELECTOR, "details#rows[data-loaded='yes']"):
        time.sleep(0.01)
    rows = driver.execute_script("return performance.now()") / 1000
    timing = driver.execute_script(
        "const n = performance.getEntriesByType('navigation')[0];"
        "return [n.startTime, n.loadEventEnd];"
    )
    return (timing[1] - timing[0]) / 1000, rows


def open_tokens_s(driver: Any) -> float:
    """Seconds from opening the first call's token view to its tokens being in the page."""
    from selenium.webdriver.common.by import By

    started = time.perf_counter()
    driver.find_element(By.CSS_SELECTOR, "section.call details.tokens > summary").click()
    while not driver.find_elements(By.CSS_SELECTOR, "section.call details.tokens .tok.gen"):
        if time.perf_counter() - started > 120:
            raise TimeoutError("the token view did not load in 120 s")
        time.sleep(0.01)
    return time.perf_counter() - started


def bench_rollout_page(rounds: int, calls_per_round: int, prompt_tokens: int) -> None:
    from dashboard_game import make_game_run

    with tempfile.TemporaryDirectory() as tmp:
        started = time.time()
        game = make_game_run(
            Path(tmp), rounds=rounds, calls_per_round=calls_per_round, prompt_tokens=prompt_tokens
        )
        size = (game.run_dir / "store.sqlite").stat().st_size / 1e6
        print(f"  written in {time.time() - started:.0f} s ({size:.0f} MB)")
        driver = chromium()
        try:
            with (
                serve_in_thread(dashboard_app(Catalog([Path(tmp)]))) as server,
                httpx.Client(base_url=server.url, timeout=120) as client,
            ):
                print(
                    f"\n  {'rollout':<12} {'page KB':>8} {'cold s':>7} {'rows s':>7} "
                    f"{'again s':>8} {'rows s':>7} {'tokens s':>9}"
                )
                for label, rollout_id in [("train game", game.train[0]), ("val game", game.val)]:
                    url = f"{server.url}/rollouts/{rollout_id}"
                    cold, cold_rows = load_s(driver, url)
                    again, rows = load_s(driver, url)
                    tokens = open_tokens_s(driver)
                    kb = len(client.get(url).content) / 1000
                    flag = "" if kb < 1000 and again < 1 else "  (over 1 MB or 1 s)"
                    print(
                        f"  {label:<12} {kb:8.0f} {cold:7.2f} {cold_rows:7.2f} {again:8.2f} "
                        f"{rows:7.2f} {tokens:9.2f}{flag}"
                    )
                print(
                    "  (Chromium: from navigation to the load event, then to the training rows "
                    "in the page; tokens: a call's token view opened)"
                )
        finally:
            driver.quit()


def train_once(run_dir: Path, name: str, steps: int) -> float:
    started = time.time()
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "dashboard_run.py"), str(run_dir), str(steps), name],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.time() - started


def bench_cost(pairs: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        train_once(root, "warmup", 1)
        plain, watched = [], []
        for k in range(pairs):  # A B, B A, A B...: drift over time falls on both alike
            for watch in (False, True) if k % 2 == 0 else (True, False):
                name = f"{'watched' if watch else 'plain'}-{k}"
                if not watch:
                    plain.append(train_once(root, name, steps))
                    continue
                stop = threading.Event()
                with serve_in_thread(dashboard_app(Catalog([root]))) as server:
                    poller = threading.Thread(target=poll, args=(server.url, stop))
                    poller.start()
                    try:
                        watched.append(train_once(root, name, steps))
                    finally:
                        stop.set()
                        poller.join()
            print(f"  pair {k}: {plain[-1]:.1f} s without, {watched[-1]:.1f} s with the dashboard")
        a, b = statistics.median(plain), statistics.median(watched)
        per_pair = statistics.median(w / p for w, p in zip(watched, plain, strict=True))
        print(f"\n  median run: {a:.1f} s without, {b:.1f} s with the dashboard open")
        print(f"  ratio of medians {b / a:.3f}; median of the pairs' ratios {per_pair:.3f}")


def poll(url: str, stop: threading.Event) -> None:
    """What a browser with the dashboard's pages open asks while the run trains: the runs
    page, the rollouts page and the run's page (its table and its chart series), each
    every 3 s (three tabs)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                runs = client.get("/").text
                ids = [s.split('"')[0] for s in runs.split('data-run-id="')[1:]]
                client.get("/rollouts")
                for run_id in ids[:1]:
                    client.get(f"/runs/{run_id}")
                    client.get(f"/api/runs/{run_id}")
            except httpx.HTTPError:
                pass
            stop.wait(3.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["pages", "cost", "rollout", "all"], default="all")
    parser.add_argument("--rollouts", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls-per-round", type=int, default=200)
    parser.add_argument("--prompt-tokens", type=int, default=2500)
    args = parser.parse_args()
    if args.part in ("pages", "all"):
        print(
            f"rollouts page on a store of {args.rollouts:,} rollouts, {args.rollouts * 10:,} calls"
        )
        bench_pages(args.rollouts, args.repeats)
    if args.part in ("cost", "all"):
        print(
            f"\ncost of an open dashboard to a LocalRL run ({args.steps} steps, {args.pairs} pairs)"
        )
        bench_cost(args.pairs, args.steps)
    if args.part in ("rollout", "all"):
        calls = args.rounds * args.calls_per_round
        print(
            f"\nrollout pages of a {args.rounds}-round game ({calls} calls, "
            f"{args.prompt_tokens:,} prompt tokens each)"
        )
        bench_rollout_page(args.rounds, args.calls_per_round, args.prompt_tokens)


if __name__ == "__main__":
    main()
