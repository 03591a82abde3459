"""End to end against the fake server: every reported metric within 2 % of the known schedule.

Expected values are computed here, independently of the tester's code, from per-token arrival
times: all tokens of the first chunk at once, then each chunk's tokens spread evenly over the gap
before it; TTFT/E2EL/TPOT from those; throughput from a simulation of the closed loop.

Two references are built:
- the nominal schedule (what the server was told to do), and
- the schedule as the server executed it (its send log: actual send times on the same
  CLOCK_MONOTONIC as the client).
Every metric must be within 2 % of the executed schedule (per-token times: plus CLIENT_DELAY_MS, the
client's read delay). The fake is held to the nominal schedule through its own log: every deadline exactly
the schedule's, no send before its deadline, and most sends on time (`_fake_schedule_problems`).
"""

from __future__ import annotations

import heapq
import json
import urllib.request

import numpy as np
import pytest

from glm5_fp4.loadtest.fake_server import spawn_fake_server
from glm5_fp4.loadtest.runner import LoadTestConfig, run_loadtest_detailed

TOL = 0.02
# The client stamps a token when its event loop reads it, the fake server when it wrote it: the difference is
# loopback plus scheduling delay, a few ms on a loaded 2-core VM whatever the metric's size. A p99 of 36 gaps is
# nearly one sample, so one late read moves it by the whole delay (client 145.3 vs sends 141.1 ms, a CI run of
# `make test`). Per-token times get that delay on top of TOL; the schedule's gaps differ by 20 ms, so a client
# that mixes chunks up, or counts the role chunk as a token, still fails.
CLIENT_DELAY_MS = 5.0
PCTS = (50.0, 90.0, 99.0)
# The fake shares a 2-core CPU with the client and pytest: one stall of the event loop makes the few sends due in
# it late (one send 15.9 ms late made the executed p99 chunk gap 165.9 ms against a schedule of 150, a CI run of
# stop 32). That moves tail percentiles of the executed schedule, not the client-vs-sends comparison, so the fake
# is judged on its sends: at least ON_TIME_SHARE of them within ON_TIME_MS of their deadline.
ON_TIME_MS = 5.0
ON_TIME_SHARE = 0.9


def _nominal_chunks(output_len: int, tpc: list[int], gaps_ms: list[float]) -> tuple[list[float], list[int]]:
    """Chunk offsets from the first chunk (ms) and tokens per chunk, as the schedule defines them."""
    offsets, tokens, done, j, t = [], [], 0, 0, 0.0
    while done < output_len:
        if j:
            t += gaps_ms[(j - 1) % len(gaps_ms)]
        k = min(tpc[j % len(tpc)], output_len - done)
        offsets.append(t)
        tokens.append(k)
        done += k
        j += 1
    return offsets, tokens


def _expected(requests: list[tuple[float, list[float], list[int]]], duration_s: float, input_len: int,
              slo_ttft: float) -> dict[str, float]:
    """Metrics from per-request (ttft_ms, chunk offsets ms, tokens per chunk)."""
    ttft, tpot, e2el, itl, chunk_itl = [], [], [], [], []
    n_out = n_chunks = 0
    for t, offsets, tokens in requests:
        tok_times = [0.0] * tokens[0]
        for j in range(1, len(offsets)):
            k = tokens[j]
            tok_times += [offsets[j - 1] + (offsets[j] - offsets[j - 1]) * m / k for m in range(1, k + 1)]
        out = sum(tokens)
        ttft.append(t)
        e2el.append(t + offsets[-1])
        tpot.append(offsets[-1] / (out - 1))
        itl += list(np.diff(tok_times))
        chunk_itl += list(np.diff(offsets))
        n_out += out
        n_chunks += len(tokens)
    n = len(requests)
    exp = {
        "completed": n, "failed": 0, "total_input_tokens": n * input_len, "total_output_tokens": n_out,
        "duration": duration_s, "request_throughput": n / duration_s, "output_throughput": n_out / duration_s,
        "total_token_throughput": (n * input_len + n_out) / duration_s,
        "request_goodput": sum(x <= slo_ttft for x in ttft) / duration_s,
        "mean_tokens_per_chunk": n_out / n_chunks,
        "output_throughput_per_user": 1e3 / float(np.mean(tpot)),
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el), ("chunk_itl", chunk_itl)):
        a = np.asarray(vals, float)
        exp[f"mean_{name}_ms"] = a.mean()
        exp[f"median_{name}_ms"] = float(np.median(a))
        exp[f"std_{name}_ms"] = a.std()
        for p in PCTS:
            exp[f"p{int(p)}_{name}_ms"] = float(np.percentile(a, p))
    return exp


def _fake_schedule_problems(log: dict, ttfts_ms: list[float], gaps_ms: list[float], tpc: list[int],
                            output_len: int) -> list[str]:
    """Where the fake's send log departs from the schedule it was given (an empty list: it kept it)."""
    offsets, tokens = _nominal_chunks(output_len, tpc, gaps_ms)
    problems, late_ms = [], []
    for rid, e in sorted(log.items()):
        due = (np.asarray(e["due"]) - e["arrival"]) * 1e3
        want = ttfts_ms[e["n"] % len(ttfts_ms)] + np.asarray(offsets)
        if e["tokens"] != tokens or len(due) != len(want) or np.abs(due - want).max() > 1e-3:
            problems.append(f"{rid}: deadlines {np.round(due, 3).tolist()} ms, tokens {e['tokens']} against the "
                            f"schedule's {want.tolist()} ms, {tokens}")
            continue
        late = (np.asarray(e["sent"]) - np.asarray(e["due"])) * 1e3
        if late.min() < 0:
            problems.append(f"{rid}: a chunk sent {-late.min():.3f} ms before its deadline")
        late_ms += late.tolist()
    if late_ms and max(late_ms) >= min(gaps_ms):  # chunks of one stream would arrive out of their spacing
        problems.append(f"a send {max(late_ms):.1f} ms late, not under the schedule's smallest gap ({min(gaps_ms)} ms)")
    if late_ms:
        on_time = float(np.mean(np.asarray(late_ms) <= ON_TIME_MS))
        if on_time < ON_TIME_SHARE:
            problems.append(f"only {on_time:.0%} of {len(late_ms)} sends within {ON_TIME_MS} ms of their deadline "
                            f"(need {ON_TIME_SHARE:.0%}; latest {max(late_ms):.1f} ms)")
    return problems


def _synthetic_log(ttfts_ms: list[float], gaps_ms: list[float], tpc: list[int], output_len: int, n: int,
                   late_ms: dict[tuple[int, int], float]) -> dict:
    """A send log as the fake writes it, every send on time but those in late_ms ((request, chunk) -> ms)."""
    offsets, tokens = _nominal_chunks(output_len, tpc, gaps_ms)
    log = {}
    for i in range(n):
        arrival = 100.0 + 0.25 * i
        due = [arrival + (ttfts_ms[i % len(ttfts_ms)] + o) / 1e3 for o in offsets]
        sent = [d + late_ms.get((i, j), 0.0) / 1e3 for j, d in enumerate(due)]
        log[f"cmpl-fake-{i}"] = {"n": i, "arrival": arrival, "due": due, "sent": sent, "tokens": list(tokens)}
    return log


def test_fake_schedule_check_allows_one_stall_and_rejects_a_broken_fake() -> None:
    c = CASES["completions-multitoken"]
    sched = (c["ttfts"], c["gaps"], c["tpc"], c["output_len"])
    # The CI failure: one stall made one send 15.9 ms late (p99 chunk gap 165.9 against 150).
    assert _fake_schedule_problems(_synthetic_log(*sched, n=10, late_ms={(3, 4): 15.9}), *sched) == []
    assert _fake_schedule_problems(_synthetic_log(*sched, n=10, late_ms={(3, 4): 15.9, (4, 2): 15.9}), *sched) == []
    # The smallest case (chat: 6 requests, 42 sends): one stall that catches all 3 streams passes.
    chat = CASES["chat-single-token"]
    csched = (chat["ttfts"], chat["gaps"], chat["tpc"], chat["output_len"])
    stall = {(i, 3): 15.9 for i in range(3)}
    assert sum(len(e["sent"]) for e in _synthetic_log(*csched, chat["n"], stall).values()) == 42
    assert _fake_schedule_problems(_synthetic_log(*csched, chat["n"], stall), *csched) == []
    # A send a whole gap late.
    assert "smallest gap" in " ".join(_fake_schedule_problems(_synthetic_log(*sched, 10, {(1, 2): 120.0}), *sched))
    # Late nearly everywhere: the fake did not keep its schedule.
    everywhere = {(i, j): 8.0 for i in range(10) for j in range(0, 8, 2)}
    assert "within 5.0 ms" in " ".join(_fake_schedule_problems(_synthetic_log(*sched, 10, everywhere), *sched))
    # A send before its deadline.
    early = _fake_schedule_problems(_synthetic_log(*sched, n=10, late_ms={(2, 1): -1.0}), *sched)
    assert len(early) == 1 and "before its deadline" in early[0]
    # Deadlines off the schedule: a wrong gap, a wrong TTFT for the arrival number, tokens per chunk mixed up.
    log = _synthetic_log(*sched, n=10, late_ms={})
    log["cmpl-fake-5"]["due"][3] += 0.02
    log["cmpl-fake-6"]["n"] = 7
    log["cmpl-fake-7"]["tokens"] = log["cmpl-fake-7"]["tokens"][::-1]
    bad = _fake_schedule_problems(log, *sched)
    assert [p.split(":")[0] for p in bad] == ["cmpl-fake-5", "cmpl-fake-6", "cmpl-fake-7"]


def _closed_loop_makespan(durations_ms: list[float], concurrency: int) -> float:
    free = [0.0] * concurrency
    end = 0.0
    for d in durations_ms:
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
        end = max(end, t + d)
    return end


def _close(got: float, want: float, key: str, ref: dict, tol: float, delay_ms: float = 0.0) -> bool:
    slack = delay_ms if key.endswith("_ms") else 0.0
    if key.startswith("std_"):  # a spread is judged on the scale of its metric
        return abs(got - want) <= tol * abs(ref["mean_" + key[4:]]) + slack
    return abs(got - want) <= tol * abs(want) + slack + 1e-9


CASES = {
    # MTP-like completions: 2 tokens in the first chunk, then 1, 3, 2, ... tokens per chunk
    "completions-multitoken": dict(endpoint="completions", ttfts=[200.0, 300.0], gaps=[100.0, 150.0],
                                   tpc=[2, 1, 3], output_len=13, concurrency=4, n=8),
    # chat: the role chunk carries no token and must not count as the first token
    "chat-single-token": dict(endpoint="chat", ttfts=[200.0], gaps=[100.0, 120.0, 140.0], tpc=[1],
                              output_len=7, concurrency=3, n=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_metrics_match_schedule(case: str, tmp_path) -> None:
    c = CASES[case]
    warmups, input_len = 2, 48
    slo_ttft = min(c["ttfts"]) + 40.0
    args = ["--ttft-ms", ",".join(map(str, c["ttfts"])), "--itl-ms", ",".join(map(str, c["gaps"])),
            "--tokens-per-chunk", ",".join(map(str, c["tpc"])), "--record-sends"]
    with spawn_fake_server(*args) as srv:
        res, rows = run_loadtest_detailed(LoadTestConfig(
            url=srv.url, endpoint=c["endpoint"], concurrency=c["concurrency"], num_prompts=c["n"],
            input_len=input_len, output_len=c["output_len"], num_warmups=warmups, warmup_output_len=2,
            percentiles=PCTS, goodput={"ttft": slo_ttft}, progress=False, telemetry=False,
            result_dir=str(tmp_path)))
        log = json.load(urllib.request.urlopen(srv.url + "/fake/send_log"))
    assert res["prompt_len_mismatches"] == 0
    assert all(r["status"] == "ok" and r["output_tokens"] == c["output_len"] for r in rows)

    offsets, tokens = _nominal_chunks(c["output_len"], c["tpc"], c["gaps"])
    arrival_ttft = [c["ttfts"][(warmups + i) % len(c["ttfts"])] for i in range(c["n"])]
    nominal = _expected([(t, offsets, tokens) for t in arrival_ttft],
                        _closed_loop_makespan([t + offsets[-1] for t in arrival_ttft], c["concurrency"]) / 1e3,
                        input_len, slo_ttft)
    t0 = res["metadata"]["start_perf_counter"]
    executed_reqs, last_send = [], 0.0
    for r in rows:
        e = log[r["response_id"]]
        sent = np.asarray(e["sent"]) * 1e3
        start = (t0 + r["start_s"]) * 1e3
        executed_reqs.append((sent[0] - start, list(sent - sent[0]), e["tokens"]))
        last_send = max(last_send, sent[-1] / 1e3)
    executed = _expected(executed_reqs, last_send - t0, input_len, slo_ttft)

    measured = {r["response_id"]: log[r["response_id"]] for r in rows}  # the warm-ups have their own length
    problems = _fake_schedule_problems(measured, c["ttfts"], c["gaps"], c["tpc"], c["output_len"])
    for key, want in nominal.items():
        got, done = res[key], executed[key]
        # The client is judged against what the server executed (its send times); against the nominal schedule
        # the two deviations add up, so a second bound of TOL against the schedule failed runs whose client was
        # within TOL of the sends (p99 ITL: client 142.99, sends 140.73, schedule 140.0 ms, once in a loaded
        # `make test`). The server itself must keep the schedule for the comparison to mean anything: its log
        # is checked above (a bound of 10 % on the executed metrics failed CI on one 15.9 ms stall).
        if not _close(got, done, key, executed, TOL, CLIENT_DELAY_MS):
            problems.append(f"{key}: got {got:.4f}, server executed {done:.4f} (nominal {want:.4f})")
    assert not problems, f"{case}: the fake left its schedule or the client's metrics are off by > 2 %:\n" + "\n".join(problems)
