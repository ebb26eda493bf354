"""Reward sources (`reward.type: function | http | builtin`): a reward server on loopback (batches,
bearer token, 5xx and timeout retries with backoff, the concurrency limit, malformed answers), the
built-in verifiers, and dict-valued rewards whose extra numbers become iteration metrics."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reflow.engines import rollout_stages as ro
from reflow.infra.config.schema import load_config
from reflow.rl.reward_http import HttpReward
from reflow.rl.rewards import RewardError
from reflow.rl.scorers import FunctionScorer, reward_source
from reflow.rl.types import RolloutBatch, Sample
from reflow.rl.verifiers import exact_match, math_answer

TOKEN = "test-reward-token"


class _Server:
    """A reward server whose behaviour per path is scripted by the test: `fail[path]` answers that
    many requests first with `fail_with` (a status, or "hang" = longer than the client's timeout)."""

    def __init__(self):
        self.fail: dict[str, int] = {}
        self.fail_with: dict[str, object] = {}
        self.requests: list[tuple[str, int, str | None]] = []  # (path, batch size, auth header)
        self.in_flight = self.max_in_flight = 0
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with server.lock:
                    server.requests.append((self.path, len(body["samples"]), self.headers.get("Authorization")))
                    server.in_flight += 1
                    server.max_in_flight = max(server.max_in_flight, server.in_flight)
                    failing = server.fail.get(self.path, 0) > 0
                    server.fail[self.path] = server.fail.get(self.path, 0) - 1
                try:
                    self._answer(body["samples"], failing)
                finally:
                    with server.lock:
                        server.in_flight -= 1

            def _answer(self, samples, failing):
                if self.path == "/slow":
                    time.sleep(0.2)
                if self.path == "/trickle":  # a valid answer, one byte every 0.15 s: each read is quick
                    return self._trickle(json.dumps({"rewards": [1.0] * len(samples)}).encode())
                if failing and server.fail_with[self.path] == "hang":
                    time.sleep(2.5)
                    return
                status, payload = (int(server.fail_with[self.path]), b"overloaded") if failing else (200, None)
                if payload is None:
                    payload = {"/malformed": b"<html>oops</html>", "/short": b'{"rewards": [1.0]}',
                               "/nolist": b'{"scores": []}'}.get(self.path) or json.dumps({"rewards": [
                                   {"score": float(s["response"] == str(s["label"])), "length": s["response_tokens"]}
                                   for s in samples]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def _trickle(self, payload):
                self.send_response(200)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    for i in range(len(payload)):
                        self.wfile.write(payload[i:i + 1])
                        time.sleep(0.15)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up: what the test wants
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"


@pytest.fixture()
def server():
    s = _Server()
    yield s
    s.httpd.shutdown()
    s.httpd.server_close()


def _samples(n: int) -> list[Sample]:
    return [Sample("q", str(i % 3), "1", "stop", 2, i, tuple(range(i))) for i in range(n)]


def test_batches_token_and_metrics(server):
    rewards, metrics = HttpReward(server.url("/ok"), batch_size=4, token=TOKEN).score(_samples(10))
    assert rewards == [float(i % 3 == 1) for i in range(10)]
    assert metrics == {"reward/length": pytest.approx(4.5)}
    assert sorted(n for _, n, _ in server.requests) == [2, 4, 4]
    assert {auth for _, _, auth in server.requests} == {f"Bearer {TOKEN}"}
    assert TOKEN not in repr(HttpReward(server.url("/ok"), token=TOKEN))


@pytest.mark.parametrize("failure", [503, "hang"])
def test_5xx_and_timeouts_are_retried_with_backoff(server, failure):
    server.fail["/ok"], server.fail_with["/ok"] = 2, failure
    t0 = time.monotonic()
    # a 1 s timeout: well past a normal answer on a loaded 2-core machine, well short of a hang
    rewards, _ = HttpReward(server.url("/ok"), timeout_s=1.0, retries=2, backoff_s=0.1).score(_samples(3))
    assert rewards == [0.0, 1.0, 0.0] and len(server.requests) == 3
    assert time.monotonic() - t0 >= 0.1 + 0.2  # the two backoffs: 0.1 s, then doubled
    server.fail["/ok"] = 3  # one more failure than there are retries
    with pytest.raises(RewardError, match=r"reward server http://127\.0\.0\.1:\d+/ok \(samples 0\.\.2\) failed 3 "
                                          r"times; last: " + ("HTTP 503: overloaded" if failure == 503 else
                                                              r"no complete answer within 1 s \(reward\.timeout_s\)")):
        HttpReward(server.url("/ok"), timeout_s=1.0, retries=2, backoff_s=0.01).score(_samples(3))


def test_timeout_is_a_deadline_for_the_whole_answer(server):
    """reward.timeout_s bounds a request from its start to the answer's last byte: a server that sends a byte
    every 0.15 s never lets one read wait that long (httpx's read timeout), and took 26 s against a 2 s timeout."""
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"/trickle \(samples 0\.\.1\) failed 2 times; last: no complete answer "
                                          r"within 0\.5 s \(reward\.timeout_s\)"):
        HttpReward(server.url("/trickle"), timeout_s=0.5, retries=1, backoff_s=0.01).score(_samples(2))
    assert time.monotonic() - t0 < 2.0  # two attempts of 0.5 s, not 3 s each for the 20 bytes
    assert len(server.requests) == 2


def test_a_reward_function_past_its_deadline_fails_the_scoring():
    """The run scores with reward.fn_timeout_s (tasks/rollout.py passes it; eval sets too)."""
    batch = RolloutBatch([0, 0], ["q", "q"], [[1], [1]], ["7", "late"], [[3], [4, 5]], [[-1.0], [-1.0, -2.0]],
                         ["stop", "stop"], ["7", "7"])
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=r"slow_on_late did not return within 0.2 s on sample 1"):
        ro.score(batch, "tests.reward_fixtures:slow_on_late", fn_timeout_s=0.2)
    assert time.monotonic() - t0 < 0.9


def test_client_errors_and_malformed_answers_fail_at_once(server):
    server.fail["/ok"], server.fail_with["/ok"] = 1, 401
    with pytest.raises(RewardError, match=r"/ok \(samples 0\.\.1\) answered HTTP 401: overloaded \(not retried\)"):
        HttpReward(server.url("/ok"), retries=3).score(_samples(2))
    for path, message in (("/malformed", "answered with a body that is not JSON: '<html>oops</html>'"),
                          ("/short", r"answered 1 rewards for 2 samples"),
                          ("/nolist", r"answered without a `rewards` list: \{'scores': \[\]\}")):
        with pytest.raises(RewardError, match=message):
            HttpReward(server.url(path), retries=3).score(_samples(2))
    assert [p for p, _, _ in server.requests] == ["/ok", "/malformed", "/short", "/nolist"]  # none repeated


def test_concurrency_limit(server):
    HttpReward(server.url("/slow"), batch_size=1, max_concurrency=2).score(_samples(6))
    assert len(server.requests) == 6 and server.max_in_flight == 2


def test_builtin_verifiers():
    assert [exact_match("", r, "42") for r in (" 42\n", "42.0", "4 2")] == [1.0, 0.0, 0.0]
    assert [math_answer("", r, lab) for r, lab in (("so the answer is $\\frac{1}{2}$", "0.5"), ("it is 42.", "42"),
                                                   ("3/4", "\\frac{3}{4}"), ("I get 41", "42"))] == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="math-verify could not parse the label ' '"):
        math_answer("", "1", " ")


def test_dict_rewards_become_metrics_and_config_picks_the_source(monkeypatch):
    batch = RolloutBatch([0, 0], ["q", "q"], [[1], [1]], ["7", "8"], [[3], [4, 5]], [[-1.0], [-1.0, -2.0]],
                         ["stop", "stop"], ["7", "7"])
    scored, stats = ro.score(batch, "tests.reward_fixtures:dict_reward")
    assert scored.rewards == [1.0, 0.0] and stats["reward/tokens"] == 1.5 and stats["reward_mean"] == 0.5
    with pytest.raises(RewardError, match="dict_without_score returned a dict without a 'score' key"):
        ro.score(batch, "tests.reward_fixtures:dict_without_score")
    def source(cfg):
        return reward_source(cfg.reward, cfg.data.reward_fn)

    assert source(load_config(None, [])) == FunctionScorer("reflow.rl.demo_task:reward", "data.reward_fn")
    assert source(load_config(None, ["reward.type=builtin", "reward.builtin=math"])) == \
        FunctionScorer("reflow.rl.verifiers:math_answer", "reward.builtin")
    cfg = load_config(None, ["reward.type=http", "reward.url=http://127.0.0.1:9/score", "reward.token_env=RW_TOKEN"])
    with pytest.raises(ValueError, match="reward.token_env='RW_TOKEN': that environment variable is not set"):
        source(cfg)
    monkeypatch.setenv("RW_TOKEN", TOKEN)
    assert source(cfg) == HttpReward("http://127.0.0.1:9/score", token=TOKEN)
    with pytest.raises(Exception, match="reward.type=http needs reward.url"):
        load_config(None, ["reward.type=http"])
