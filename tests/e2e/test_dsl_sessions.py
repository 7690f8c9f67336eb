"""DSL programs in server sessions (frontend_lang/backend/sessions.py) against the real server (tiny
llama, fp32): what each request sends, that the outputs equal the same program without sessions,
that the session is closed at the end, forks branch from one session request, streaming, and that a
session the server no longer knows turns sessions off for the program instead of failing it. After
each test the KV pool is fully free again (no session left holding its locks).
"""

from __future__ import annotations

import threading

import httpx
import pytest

import radixlm.api as sgl
from tests.server_fixtures import ServerProcess, server_fixture, wait_kv_free

server = server_fixture("--device", "cpu", "--dtype", "float32", "--context-length", "2048",
                        "--max-total-tokens", "32768")


class RecordingEndpoint(sgl.RuntimeEndpoint):
    """A RuntimeEndpoint that keeps every (path, body) it sends."""

    def __init__(self, *args, **kwargs) -> None:
        self.sent: list[tuple[str, dict]] = []
        self._sent_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def _record(self, path: str, body) -> None:
        with self._sent_lock:
            self.sent.append((path, body))

    def _request(self, method, path, body=None):
        if body is not None:
            self._record(path, body)
        return super()._request(method, path, body)

    def _stream(self, body):
        self._record("/generate", body)
        return super()._stream(body)

    def generates(self) -> list[dict]:
        return [body for path, body in self.sent if path == "/generate"]


@pytest.fixture
def endpoint(server: ServerProcess):
    ep = RecordingEndpoint(server.base_url)
    yield ep
    ep.close()
    wait_kv_free(server)     # every program closed its session: no KV left locked


@pytest.fixture(scope="module")
def plain(server: ServerProcess):
    ep = sgl.RuntimeEndpoint(server.base_url, use_sessions=False)
    yield ep
    ep.close()


@sgl.function
def three_turns(s, between=None):
    s += sgl.system("You are terse.")
    for i, question in enumerate(["What is os.path?", "And sys?", "And pathlib?"]):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen(f"a{i}", max_tokens=8))
        if between is not None:
            between(s, i)


def outputs(state, names) -> list:
    return [state[n] for n in names]


def test_turns_send_only_the_new_text_and_match_a_program_without_sessions(endpoint, plain, server):
    state = three_turns.run(temperature=0, backend=endpoint)
    reference = three_turns.run(temperature=0, backend=plain)
    names = ["a0", "a1", "a2"]
    assert outputs(state, names) == outputs(reference, names)
    assert state.text() == reference.text()
    for name in names:   # the server saw the same tokens
        assert state.get_meta_info(name)["prompt_tokens"] == reference.get_meta_info(name)["prompt_tokens"]

    first, second, third = endpoint.generates()
    assert "session_params" not in first                       # a one-request program pays nothing
    sid = second["session_params"]["id"]
    assert second["session_params"] == {"id": sid}              # opened at the second request: a new root
    assert second["text"].startswith(first["text"] + state["a0"]) and state.text().startswith(second["text"])
    assert third["session_params"] == {"id": sid, "rid": second["rid"], "drop_previous_output": True}
    assert second["text"] + third["text"] == state.text()[:len(second["text"]) + len(third["text"])]
    assert third["text"].startswith(state["a1"])                # the previous output, re-sent as text
    assert state.get_meta_info("a2")["cached_tokens"] >= state.get_meta_info("a1")["prompt_tokens"] - 1

    paths = [path for path, _ in endpoint.sent]
    assert paths.count("/open_session") == 1 and paths[-1] == "/close_session"
    assert endpoint.sent[-1][1] == {"session_id": sid}
    # closed: the server no longer knows it
    r = httpx.post(server.url("/generate"), json={"text": "x", "session_params": {"id": sid}}, timeout=30)
    assert r.status_code == 400 and "session" in r.json()["error"]["message"]


PREFIX = "import os\nimport sys\nfrom pathlib import Path\n" * 8


@sgl.function
def branches(s):
    s += PREFIX
    forks = s.fork(3)
    for i, branch in enumerate(forks):
        branch += f"# variant {i}\n" + sgl.gen("code", max_tokens=4)
        branch += "\n# again\n" + sgl.gen("more", max_tokens=4)
    forks.join()


def test_forks_branch_from_one_session_request(endpoint, plain):
    state = branches.run(temperature=0, backend=endpoint)
    reference = branches.run(temperature=0, backend=plain)
    assert state["code"] == reference["code"] and state["more"] == reference["more"]

    sent = endpoint.generates()
    prefix_req = sent[0]   # the fork's prefill opens the session at once
    sid = prefix_req["session_params"]["id"]
    assert prefix_req["text"] == PREFIX and prefix_req["sampling_params"] == {"max_new_tokens": 0}
    first_gens = [b for b in sent[1:] if b["text"].startswith("# variant")]
    assert len(first_gens) == 3
    for body in first_gens:
        assert body["session_params"] == {"id": sid, "rid": prefix_req["rid"], "drop_previous_output": True}
    second_gens = [b for b in sent[1:] if b not in first_gens]
    assert sorted(b["session_params"]["rid"] for b in second_gens) == sorted(b["rid"] for b in first_gens)
    for child in state.stream_executor.children:
        assert child.meta_info["code"]["cached_tokens"] >= len(PREFIX) // 8   # the prefix's KV
    assert [path for path, _ in endpoint.sent].count("/close_session") == 1


def test_streamed_turns_use_the_session(endpoint, plain):
    streamed = three_turns.run(temperature=0, stream=True, backend=endpoint)
    pieces = list(streamed.text_iter())
    reference = three_turns.run(temperature=0, backend=plain)
    assert "".join(pieces) == reference.text()
    sent = endpoint.generates()
    assert [("session_params" in b) for b in sent] == [False, True, True] and all(b["stream"] for b in sent)


def test_a_session_the_server_forgot_turns_sessions_off_for_the_program(endpoint, plain, server):
    def close_it_behind_the_programs_back(s, i):
        if i == 1:
            s.sync()
            sid = s.stream_executor.session_.session.session_id
            httpx.post(server.url("/close_session"), json={"session_id": sid}, timeout=30).raise_for_status()

    state = three_turns.run(temperature=0, backend=endpoint, between=close_it_behind_the_programs_back)
    reference = three_turns.run(temperature=0, backend=plain)
    assert outputs(state, ["a0", "a1", "a2"]) == outputs(reference, ["a0", "a1", "a2"])
    sent = endpoint.generates()
    assert len(sent) == 4     # the refused third turn, then the same turn without the session
    assert "session_params" in sent[2] and "session_params" not in sent[3]
    assert sent[3]["text"].startswith(sent[0]["text"]) and state.text().startswith(sent[3]["text"])  # all of it


def test_use_sessions_false_sends_whole_texts(plain, server):
    rec = RecordingEndpoint(server.base_url, use_sessions=False)
    try:
        three_turns.run(temperature=0, backend=rec)
    finally:
        rec.close()
    assert all("session_params" not in b for b in rec.generates())
    assert not any(path.endswith("_session") for path, _ in rec.sent)
