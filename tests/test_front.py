"""The host front as render-units and the roles write it, run by Debian's HAProxy in front of a real
worker on loopback: TLS, a key per client, the clients' limits, and the name the workers count by.

The fleet front includes the same rules (templates/haproxy-rules.j2); the fleet tier runs it on hosts.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import re
import socket
import ssl
import threading
import time
import warnings

import httpx
import openai
import pytest
import yaml

from conftest import TOOL_ENV, free_port, run_tool
from harness.haproxy import Front, fleet_certificates, self_signed
from vlserve.bench.servers import LocalServer
from vlserve.ops import clients, units

FACTS = pathlib.Path(__file__).parent / "fixtures" / "topologies" / "xeon-avx512bf16-2vcpu-vm.json"
KEYS = {
    "alice": "vls-alice-" + "a" * 40,
    "bob": "vls-bob-" + "b" * 40,
    "carol": "vls-carol-" + "c" * 40,
    "dave": "vls-dave-" + "d" * 40,
}
KEY_FILE = [
    {"name": "alice", "key": KEYS["alice"], "limits": {"concurrent": 1}},
    {"name": "bob", "key": KEYS["bob"], "limits": {"requests_per_minute": 3}},
    {"name": "carol", "key": KEYS["carol"], "limits": {"models": ["another-model"]}},
    {"name": "dave", "key": KEYS["dave"], "limits": {"tokens_per_minute": 20}},
]


@pytest.fixture(scope="module")
def fronted(tiny_model, tmp_path_factory):
    """A worker on the tiny model behind the host front with TLS and the four clients."""
    work = tmp_path_factory.mktemp("front")
    pem, cert = self_signed(work)
    (work / "keys.yml").write_text(yaml.safe_dump({"vlserve_clients": KEY_FILE}))
    worker_port, front_port = free_port(), free_port()
    tree = work / "tree"
    result = run_tool(
        "vlserve", "render-units", "--out", str(tree), "--facts", str(FACTS), "--max-workers", "1",
        "--base-port", str(worker_port), "--front-port", str(front_port), "--front-bind", "127.0.0.1",
        "--clients", str(work / "keys.yml"), "--tls-pem", str(pem),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    worker = LocalServer(tiny_model, port=worker_port, environment=TOOL_ENV).wait_ready(timeout_s=180)
    front = Front(tree, units.CONFIG_FILES["haproxy.cfg.j2"])
    url = "https://127.0.0.1:%d" % front_port
    front.start(url + "/readyz", ca=ssl.create_default_context(cafile=str(cert)))
    yield {
        "url": url,
        "ca": str(cert),
        "trust": ssl.create_default_context(cafile=str(cert)),
        "worker": worker,
        "front": front,
        "tree": tree,
        "port": front_port,
    }
    front.stop()
    worker.stop()


def call(fronted, path="/v1/models", key=None, method="GET", **kwargs) -> httpx.Response:
    headers = dict(kwargs.pop("headers", {}))
    if key:
        headers["Authorization"] = "Bearer " + key
    return httpx.request(method, fronted["url"] + path, headers=headers, verify=fronted["trust"], timeout=120, **kwargs)


def worker_requests(fronted) -> float:
    """Every /v1/ request the worker itself counted."""
    samples = httpx.get(fronted["worker"].url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in samples.splitlines() if line.startswith("vlserve_requests_total{")
    )


def worker_metric(fronted, name: str, **labels) -> float:
    wanted = ",".join('%s="%s"' % item for item in sorted(labels.items()))
    prefix = "%s{%s} " % (name, wanted) if labels else name + " "
    for line in httpx.get(fronted["worker"].url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(max_tokens=4, stream=False, model="qwen3-vl-2b-instruct") -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


def test_the_front_holds_digests_not_keys_and_none_readable_by_others(fronted):
    texts = [path.read_bytes() for path in fronted["tree"].rglob("*") if path.is_file()]
    for key in KEYS.values():
        assert not any(key.encode() in text for text in texts)
    clients_map = fronted["tree"] / units.CONFIG_FILES["clients.map.j2"].lstrip("/")
    assert clients.key_digest(KEYS["bob"]) in clients_map.read_text()
    written = run_tool(
        "vlserve", "render-units", "--out", str(fronted["tree"] / "again"), "--facts", str(FACTS),
        "--front-bind", "127.0.0.1", "--tls-pem", str(fronted["tree"].parent / "front.pem"),
        "--clients", str(fronted["tree"].parent / "keys.yml"),
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    again = fronted["tree"] / "again"
    for private in (units.CONFIG_FILES["clients.map.j2"], units.FRONT_PEM):
        assert (again / private.lstrip("/")).stat().st_mode & 0o777 == 0o640, private
    assert (again / units.CONFIG_FILES["haproxy.cfg.j2"].lstrip("/")).stat().st_mode & 0o777 == 0o644


def raw_exchange(url: str, ca: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One request written as is over TLS (what httpx would not send): the status, headers, body."""
    host, port = url.removeprefix("https://").rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    with (
        socket.create_connection((host, int(port)), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname=host) as tls,
    ):
        tls.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += tls.recv(65536)
        head, body = answer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines)}
        while len(body) < int(headers["content-length"]):  # not to the end: a refused upload's connection stays
            body += tls.recv(65536)
    return int(status_line.split()[1]), headers, body


def assert_front_error(status, headers, body, expected_status, expected_code):
    assert status == expected_status, body
    assert headers["content-type"] == "application/json" and headers["cache-control"] == "no-cache"
    message, kind, code, extra = units.ERROR_PAGES[expected_status]
    assert json.loads(body) == {"error": {"message": message, "type": kind, "param": None, "code": expected_code}}
    assert code == expected_code
    for name, value in extra.items():
        assert headers[name.lower()] == value


@pytest.mark.parametrize(
    ("request_bytes", "status", "code"),
    [
        *(
            (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (KEYS["alice"].encode(), length, b"x" * 20000),
                413,
                "request_too_large",
            )
            # Over the limit, and over 2^31 (what a 32-bit reading of the length let through); a
            # buffer's worth of body: the front reads that much before its rules.
            for length in (21 * 2**20, 2**31 + 1, 10**12)
        ),
        (b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 401, "invalid_api_key"),
    ],
    ids=["over-the-upload-limit", "over-2^31", "over-2^39", "no-key"],
)
def test_what_the_front_refuses_itself_is_the_service_error_shape_with_its_headers(
    fronted, request_bytes, status, code
):
    """HAProxy's own answers (its http-error lines), not its HTML pages: JSON a client parses like the
    workers' errors, and the headers it acts on (WWW-Authenticate on a 401)."""
    assert_front_error(*raw_exchange(fronted["url"], fronted["ca"], request_bytes), status, code)


def test_a_front_with_no_worker_answers_503_in_the_error_shape_with_retry_after(tmp_path):
    pem, cert = self_signed(tmp_path)
    (tmp_path / "keys.yml").write_text(yaml.safe_dump({"vlserve_clients": KEY_FILE}))
    front_port, tree = free_port(), tmp_path / "tree"
    result = run_tool(
        "vlserve", "render-units", "--out", str(tree), "--facts", str(FACTS), "--max-workers", "1",
        "--base-port", str(free_port()), "--front-port", str(front_port), "--front-bind", "127.0.0.1",
        "--clients", str(tmp_path / "keys.yml"), "--tls-pem", str(pem),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    url = "https://127.0.0.1:%d" % front_port
    front = Front(tree, units.CONFIG_FILES["haproxy.cfg.j2"]).start(
        url + "/readyz", ca=ssl.create_default_context(cafile=str(cert))
    )
    try:
        request = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\nConnection: close\r\n\r\n"
        answer = raw_exchange(url, str(cert), request % KEYS["alice"].encode())
    finally:
        front.stop()
    assert_front_error(*answer, 503, "no_worker_ready")


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer vls-not-a-key-" + "x" * 40},
        {"Authorization": "Bearer " + "y" * 400},  # oversized: not even hashed
        {"Authorization": "Basic " + KEYS["alice"]},
    ],
    ids=["missing", "wrong", "oversized", "not-bearer"],
)
def test_a_request_without_a_valid_key_gets_401_json_and_never_reaches_a_worker(fronted, headers):
    before = worker_requests(fronted)
    refused = call(fronted, headers=headers)
    assert refused.status_code == 401
    assert refused.json()["error"]["type"] == "authentication_error"
    assert refused.headers["www-authenticate"] == "Bearer"
    assert worker_requests(fronted) == before


def test_tls_is_1_2_or_1_3_with_h2_and_older_handshakes_are_refused(fronted):
    for version in (ssl.TLSVersion.TLSv1_2, ssl.TLSVersion.TLSv1_3):
        context = ssl.create_default_context(cafile=fronted["ca"])
        context.minimum_version = context.maximum_version = version
        context.set_alpn_protocols(["h2", "http/1.1"])
        with (
            socket.create_connection(("127.0.0.1", fronted["port"]), timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
        ):
            assert tls.version() == {ssl.TLSVersion.TLSv1_2: "TLSv1.2", ssl.TLSVersion.TLSv1_3: "TLSv1.3"}[version]
            assert tls.selected_alpn_protocol() == "h2"
    # TLS 1.0 and 1.1: OpenSSL's default security level here may refuse to offer them at all; the
    # client is allowed to (level 0) so that the refusal seen is the front's.
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.check_hostname, old.verify_mode = False, ssl.CERT_NONE
    old.set_ciphers("ALL:@SECLEVEL=0")
    with warnings.catch_warnings():  # deprecated: the point of the test
        warnings.simplefilter("ignore", DeprecationWarning)
        old.minimum_version, old.maximum_version = ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1
    with socket.create_connection(("127.0.0.1", fronted["port"]), timeout=10) as raw, pytest.raises(ssl.SSLError):
        old.wrap_socket(raw, server_hostname="127.0.0.1")
    with pytest.raises(httpx.RemoteProtocolError):  # plain HTTP on the TLS port: closed, nothing served
        httpx.get("http://127.0.0.1:%d/v1/models" % fronted["port"], timeout=10)


def test_the_openai_client_trusts_the_front_by_its_ca_and_the_worker_counts_the_client(fronted):
    before = worker_metric(fronted, "vlserve_client_completion_tokens_total", client="alice")
    client = openai.OpenAI(
        base_url=fronted["url"] + "/v1", api_key=KEYS["alice"], http_client=httpx.Client(verify=fronted["trust"])
    )
    answer = client.chat.completions.create(
        model="qwen3-vl-2b-instruct",
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Vlserve-Client": "bob"},  # a client cannot name itself: the front drops it
    )
    assert answer.usage.completion_tokens == 3
    assert worker_metric(fronted, "vlserve_client_completion_tokens_total", client="alice") == before + 3
    assert worker_metric(fronted, "vlserve_client_completion_tokens_total", client="bob") == 0
    assert worker_metric(fronted, "vlserve_client_prompt_tokens_total", client="alice") >= answer.usage.prompt_tokens


def test_a_client_over_its_concurrency_gets_429_while_its_stream_goes_on(fronted):
    streamed: dict = {}

    def long_stream():
        with httpx.stream(
            "POST", fronted["url"] + "/v1/chat/completions", json=chat(max_tokens=200, stream=True),
            headers={"Authorization": "Bearer " + KEYS["alice"]}, verify=fronted["trust"], timeout=120,
        ) as response:  # fmt: skip
            streamed["status"] = response.status_code
            streamed["events"] = sum(1 for line in response.iter_lines() if line.startswith("data: {"))

    before = worker_metric(fronted, "vlserve_client_requests_total", client="alice", outcome="ok")
    thread = threading.Thread(target=long_stream)
    thread.start()
    deadline = time.monotonic() + 30
    while worker_metric(fronted, "vlserve_batch_size") < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    second = call(fronted, "/v1/chat/completions", KEYS["alice"], "POST", json=chat())
    other = call(fronted, "/v1/chat/completions", KEYS["dave"], "POST", json=chat(max_tokens=2))
    thread.join()
    assert second.status_code == 429, second.text
    assert second.json()["error"]["code"] == "concurrency_limit"
    assert second.headers["retry-after"] == "1"
    assert other.status_code == 200  # another client is not held by alice's limit
    assert streamed["status"] == 200 and streamed["events"] >= 10  # the stream went on to its end
    assert call(fronted, "/v1/chat/completions", KEYS["alice"], "POST", json=chat()).status_code == 200
    assert worker_metric(fronted, "vlserve_client_requests_total", client="alice", outcome="ok") == before + 2


def test_a_client_over_its_requests_per_minute_gets_429_with_retry_after(fronted):
    answers = [call(fronted, key=KEYS["bob"]) for _ in range(5)]
    assert [a.status_code for a in answers] == [200, 200, 200, 429, 429]
    refused = answers[3].json()["error"]
    assert refused == {
        "message": "this API key is over its requests per minute",
        "type": "rate_limit_error",
        "param": None,
        "code": "rate_limit",
    }
    assert 1 <= int(answers[3].headers["retry-after"]) <= 60
    assert call(fronted, key=KEYS["carol"]).status_code == 200


def test_a_client_over_its_tokens_per_minute_is_refused_by_what_it_reserves(fronted):
    # 20 tokens a minute: 15 fit, another 15 do not (until the minute turns: then it may pass).
    first = call(fronted, "/v1/chat/completions", KEYS["dave"], "POST", json=chat(max_tokens=15))
    second = call(fronted, "/v1/chat/completions", KEYS["dave"], "POST", json=chat(max_tokens=15))
    if second.status_code == 200:  # the first fell in the minute before
        second = call(fronted, "/v1/chat/completions", KEYS["dave"], "POST", json=chat(max_tokens=15))
    assert first.status_code == 200
    assert second.status_code == 429 and second.json()["error"]["code"] == "token_limit"
    assert 1 <= int(second.headers["retry-after"]) <= 60


def test_a_client_may_name_only_its_models(fronted):
    refused = call(fronted, "/v1/chat/completions", KEYS["carol"], "POST", json=chat())
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "model_not_allowed"
    allowed = call(fronted, "/v1/chat/completions", KEYS["carol"], "POST", json=chat(model="another-model"))
    assert allowed.status_code != 403  # the worker answers for its own model whatever the name


def test_a_new_key_set_is_taken_by_a_reload_without_a_failed_request(fronted):
    failures, done = [], threading.Event()

    def loop():
        while not done.is_set():
            answer = call(fronted, "/v1/chat/completions", KEYS["dave"], "POST", json=chat(max_tokens=1))
            if answer.status_code not in (200, 429):  # dave's token limit may bite: not a failure
                failures.append(answer.status_code)

    thread = threading.Thread(target=loop)
    thread.start()
    rotated = [dict(entry) for entry in KEY_FILE]
    rotated[1] = dict(rotated[1], key="vls-bob-rotated-" + "r" * 40)
    clients_map = fronted["tree"] / units.CONFIG_FILES["clients.map.j2"].lstrip("/")
    original = clients_map.read_text()
    try:
        clients_map.write_text(original.replace(clients.key_digest(KEYS["bob"]), clients.key_digest(rotated[1]["key"])))
        fronted["front"].reload()
        deadline = time.monotonic() + 20
        while call(fronted, key=rotated[1]["key"]).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert call(fronted, key=rotated[1]["key"]).status_code in (200, 429)
        assert call(fronted, key=KEYS["bob"]).status_code == 401
    finally:
        clients_map.write_text(original)
        fronted["front"].reload()
        time.sleep(1)
        done.set()
        thread.join()
    assert failures == []


@pytest.fixture(scope="module")
def behind_fleet(fronted, tmp_path_factory):
    """The same worker behind a host front that answers only the fleet front (mutual TLS), and a fleet
    front before it, with certificates from one private CA, as the roles make them."""
    work = tmp_path_factory.mktemp("fleet")
    ca, pems = fleet_certificates(work, stranger="someone else")
    keys = work / "keys.yml"
    keys.write_text(yaml.safe_dump(KEY_FILE))
    host_port, fleet_port = free_port(), free_port()
    host_tree, fleet_tree = work / "host", work / "front"
    rendered = run_tool(
        "vlserve", "render-units", "--out", str(host_tree), "--facts", str(FACTS), "--max-workers", "1",
        "--base-port", str(fronted["worker"].port), "--front-port", str(host_port), "--front-bind", "127.0.0.1",
        "--clients", str(keys), "--tls-pem", str(pems["host"]), "--fleet-ca", str(ca),
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    fleet_rendered = run_tool(
        "vlserve", "render-fleet", "--out", str(fleet_tree), "--backend", "h1=127.0.0.1:%d" % host_port,
        "--port", str(fleet_port), "--bind", "127.0.0.1", "--clients", str(keys), "--tls-pem", str(pems["fleet"]),
        "--backend-ca", str(ca), "--client-pem", str(pems["client"]), "--check-interval-s", "1",
    )  # fmt: skip
    assert fleet_rendered.returncode == 0, fleet_rendered.stderr
    as_fleet = ssl.create_default_context(cafile=str(ca))
    as_fleet.load_cert_chain(str(pems["client"]))
    host = Front(host_tree, units.CONFIG_FILES["haproxy.cfg.j2"]).start(
        "https://127.0.0.1:%d/readyz" % host_port, ca=as_fleet
    )
    trust = ssl.create_default_context(cafile=str(ca))
    fleet = Front(
        fleet_tree, units.FLEET_FILES["fleet-haproxy.cfg.j2"], unit=units.FLEET_FILES["vlserve-fleet.service.j2"]
    ).start("https://127.0.0.1:%d/readyz" % fleet_port, ca=trust)
    yield {
        "ca": ca,
        "pems": pems,
        "keys": keys,
        "trust": trust,
        "host_port": host_port,
        "host": "https://127.0.0.1:%d" % host_port,
        "fleet": "https://127.0.0.1:%d" % fleet_port,
        "socket": host_tree / units.LOCAL_SOCKET.lstrip("/"),
        "host_front": host,
        "fleet_front": fleet,
        "fleet_tree": fleet_tree,
    }
    fleet.stop()
    host.stop()


def test_behind_a_fleet_front_a_host_answers_only_the_fleet_front_and_itself(behind_fleet):
    key = {"Authorization": "Bearer " + KEYS["carol"]}
    deadline = time.monotonic() + 20
    while (
        through := httpx.get(behind_fleet["fleet"] + "/v1/models", headers=key, verify=behind_fleet["trust"])
    ).status_code == 503:
        assert time.monotonic() < deadline, "the fleet front never found the host up"
        time.sleep(0.5)  # its first health check, over mutual TLS
    assert through.status_code == 200, through.text
    # Straight to the host: without a client certificate, or with a server's certificate of the same
    # CA (another front's), the handshake fails; a client certificate of the CA with another name, 403.
    for pem in (None, behind_fleet["pems"]["host"]):
        context = ssl.create_default_context(cafile=str(behind_fleet["ca"]))
        if pem:
            context.load_cert_chain(str(pem))
        with pytest.raises(httpx.TransportError):
            httpx.get(behind_fleet["host"] + "/v1/models", headers=key, verify=context, timeout=10)
    stranger = ssl.create_default_context(cafile=str(behind_fleet["ca"]))
    stranger.load_cert_chain(str(behind_fleet["pems"]["stranger"]))
    refused = httpx.get(behind_fleet["host"] + "/v1/models", headers=key, verify=stranger, timeout=10)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "fleet_front_only"
    # The host itself, on the local socket: plain HTTP, the keys still checked.
    local = httpx.Client(transport=httpx.HTTPTransport(uds=str(behind_fleet["socket"])), timeout=10)
    assert local.get("http://localhost/v1/models", headers=key).status_code == 200
    assert local.get("http://localhost/v1/models").status_code == 401


def logged(front: Front, text: str) -> str:
    """The front's log line (HAProxy writes it when the request ends) that holds `text`."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for line in front.log.read_text(errors="replace").splitlines():
            if text in line:
                return line
        time.sleep(0.1)
    raise AssertionError("%s is not in %s" % (text, front.log))


def worker_logged(log: pathlib.Path, pattern: str) -> bool:
    """Whether the worker's log holds a line matching `pattern`: its request record is written as the
    request ends, which may come after the client has read the response."""
    deadline = time.monotonic() + 10
    while not re.search(pattern, log.read_text(errors="replace")):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_a_request_keeps_one_id_from_the_fleet_front_to_the_workers_record(behind_fleet, fronted):
    key = {"Authorization": "Bearer " + KEYS["alice"]}
    fleet = behind_fleet["fleet"] + "/v1/chat/completions"

    def ask(**headers) -> httpx.Response:
        return httpx.post(fleet, json=chat(), headers=key | headers, verify=behind_fleet["trust"], timeout=60)

    kept = ask(**{"X-Request-Id": "client-chosen-0042"})
    assert kept.status_code == 200 and kept.headers["x-request-id"] == "client-chosen-0042"
    made = ask(**{"X-Request-Id": "bad id"}).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    for request_id in ("client-chosen-0042", made):
        # Both fronts' log lines end with it, and the worker's record names it with its client.
        assert logged(behind_fleet["fleet_front"], '"POST /v1/chat/completions HTTP/1.1" ' + request_id)
        assert logged(behind_fleet["host_front"], request_id)
        record = r"request %s: POST /v1/chat/completions 200 in \d+ ms, client alice" % request_id
        assert worker_logged(pathlib.Path(fronted["worker"].log.name), record)
    # A refusal of the front's own (no key) carries a new ID too, in its header and its log line.
    refused = httpx.post(fleet, json=chat(), verify=behind_fleet["trust"], timeout=60)
    assert refused.status_code == 401 and re.fullmatch(r"[0-9a-f]{32}", refused.headers["x-request-id"])
    assert " 401 " in logged(behind_fleet["fleet_front"], refused.headers["x-request-id"])


def admin(tree: pathlib.Path, command: str) -> str:
    """A command on a rendered fleet front's runtime socket."""
    with socket.socket(socket.AF_UNIX) as connection:
        connection.connect(str(tree / units.FLEET_SOCKET.lstrip("/")))
        connection.sendall(command.encode() + b"\n")
        return b"".join(iter(lambda: connection.recv(65536), b"")).decode()


def worker_pid(tree: pathlib.Path) -> int:
    return int(re.search(r"^Pid: (\d+)", admin(tree, "show info"), re.M).group(1))


def admin_state(tree: pathlib.Path, server: str) -> int:
    """A server's srv_admin_state in the runtime API's `show servers state` (8: drained by hand)."""
    lines = [line.split() for line in admin(tree, "show servers state").splitlines() if not line.startswith("#")]
    return next(int(fields[6]) for fields in lines if len(fields) > 6 and fields[3] == server)


def reload_and_wait(front: Front, tree: pathlib.Path) -> None:
    """The unit's reload, then until the new HAProxy worker answers the runtime API."""
    before = worker_pid(tree)
    front.reload()
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(OSError, AttributeError):
            if worker_pid(tree) != before:
                return
        assert time.monotonic() < deadline, "no new worker after the reload"
        time.sleep(0.2)


def test_the_fleet_front_keeps_a_drained_host_drained_across_reloads_and_cuts_no_stream(behind_fleet):
    tree, front = behind_fleet["fleet_tree"], behind_fleet["fleet_front"]
    key = {"Authorization": "Bearer " + KEYS["alice"]}
    # A stream under way when the unit reloads the front: the old worker carries it to its end.
    with httpx.stream(
        "POST", behind_fleet["fleet"] + "/v1/chat/completions", json=chat(max_tokens=600, stream=True),
        headers=key, verify=behind_fleet["trust"], timeout=120,
    ) as stream:  # fmt: skip
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        reload_and_wait(front, tree)
        rest = [line for line in lines if line]
    # (to its end: all 600 tokens, finish_reason "length")
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in rest[-2]
    # A host drained through the runtime API (as the rollout does) stays drained in the new workers,
    # across a reload and a stop and start; put back, it stays back.
    admin(tree, "set server %s/h1 state drain" % units.FLEET_BACKEND)
    assert admin_state(tree, "h1") & 8
    reload_and_wait(front, tree)
    assert admin_state(tree, "h1") & 8
    front.stop()
    front.start(behind_fleet["fleet"] + "/readyz", ca=behind_fleet["trust"])
    assert admin_state(tree, "h1") & 8
    saved = (tree / units.FLEET_STATE_FILE.lstrip("/")).read_text()
    assert re.search(r"^\d+ %s \d+ h1 \S+ \d+ 8 " % units.FLEET_BACKEND, saved, re.M), saved
    admin(tree, "set server %s/h1 state ready" % units.FLEET_BACKEND)
    reload_and_wait(front, tree)
    assert admin_state(tree, "h1") == 0


def test_two_fleet_fronts_share_each_clients_counters(behind_fleet, tmp_path):
    """Two fleet fronts over one host, peers of each other: bob's requests per minute (3) count on
    both, whichever front a request takes."""
    ports = {name: (free_port(), free_port()) for name in ("f1", "f2")}  # (clients, peers)
    peers = [arg for name, (_, peer) in ports.items() for arg in ("--peer", "%s=127.0.0.1:%d" % (name, peer))]
    fronts, trees = {}, {}
    try:
        for name, (port, _) in ports.items():
            trees[name] = tmp_path / name
            rendered = run_tool(
                "vlserve", "render-fleet", "--out", str(trees[name]), "--port", str(port), "--bind", "127.0.0.1",
                "--backend", "h1=127.0.0.1:%d" % behind_fleet["host_port"], "--backend-ca", str(behind_fleet["ca"]),
                "--client-pem", str(behind_fleet["pems"]["client"]), "--tls-pem", str(behind_fleet["pems"]["fleet"]),
                "--clients", str(behind_fleet["keys"]), "--peers-ca", str(behind_fleet["ca"]), *peers,
                "--peer-name", name,
            )  # fmt: skip
            assert rendered.returncode == 0, rendered.stderr
            url = "https://127.0.0.1:%d" % port
            fronts[name] = Front(trees[name], units.FLEET_FILES["fleet-haproxy.cfg.j2"]).start(
                url + "/readyz", ca=behind_fleet["trust"]
            )

        def models(name: str) -> int:
            url = "https://127.0.0.1:%d/v1/models" % ports[name][0]
            headers = {"Authorization": "Bearer " + KEYS["bob"]}
            return httpx.get(url, headers=headers, verify=behind_fleet["trust"], timeout=30).status_code

        deadline = time.monotonic() + 20
        ready = "https://127.0.0.1:%d/readyz" % ports["f1"][0]
        while httpx.get(ready, verify=behind_fleet["trust"]).status_code != 200:  # outside /v1/: not counted
            assert time.monotonic() < deadline, "f1 never found the host up"
            time.sleep(0.5)
        assert [models("f1"), models("f1")] == [200, 200]
        deadline = time.monotonic() + 10
        while "http_req_rate(60000)=2" not in admin(trees["f2"], "show table vlserve_clients"):
            assert time.monotonic() < deadline, admin(trees["f2"], "show peers")
            time.sleep(0.2)
        assert [models("f2"), models("f2")] == [200, 429]  # the third of the minute passes, the fourth not
    finally:
        for front in fronts.values():
            front.stop()


def test_render_refuses_a_front_beyond_loopback_without_tls_and_keys(tmp_path):
    for command, extra in (
        ("render-units", ["--facts", str(FACTS)]),
        ("render-fleet", ["--backend", "a=127.0.1.1:8100"]),
    ):
        result = run_tool("vlserve", command, "--out", str(tmp_path / command), *extra)
        assert result.returncode == 2, result.stderr
        assert "without TLS and API keys" in result.stderr and len(result.stderr.strip().splitlines()) == 1
        assert not (tmp_path / command).exists()
        opened = run_tool("vlserve", command, "--out", str(tmp_path / command), "--insecure", *extra)
        assert opened.returncode == 0, opened.stderr


@pytest.mark.parametrize(
    "entries, message",
    [
        ([{"name": "Alice", "key": "k" * 40}], "client 1: name must be"),
        ([{"name": "a", "key": "short-key"}], "client 1 (a): key is 9 characters; it must be 32-256"),
        ([{"name": "a", "key": "k" * 40}, {"name": "a", "key": "j" * 40}], "client 2 (a): a second client"),
        ([{"name": "a", "key": "k" * 40}, {"name": "b", "key": "k" * 40}], "client 2 (b): the same key"),
        ([{"name": "a", "key": "k" * 40, "limits": {"concurrent": 0}}], "limits.concurrent must be a whole number"),
        ([{"name": "a", "key": "k" * 40, "limits": {"burst": 3}}], "unknown limit burst"),
        ([{"name": "a", "key": "k k" + "k" * 40}], "printable ASCII without spaces"),
        ({"name": "a"}, "expected a list of clients"),
    ],
)
def test_a_bad_key_file_is_one_line_naming_the_client_and_never_the_key(tmp_path, entries, message):
    with pytest.raises(clients.ClientsError) as raised:
        clients.parse_clients(entries, "keys.yml")
    assert message in str(raised.value)
    for entry in entries if isinstance(entries, list) else []:
        assert entry["key"] not in str(raised.value)
    path = tmp_path / "keys.yml"
    path.write_text(yaml.safe_dump(entries))
    result = run_tool("vlserve", "keys", "check", str(path))
    assert result.returncode == 2 and message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_keys_new_makes_a_key_the_check_accepts_and_shows_only_digests(tmp_path):
    path = tmp_path / "keys.yml"
    for name in ("web", "batch"):
        result = run_tool("vlserve", "keys", "new", name, "--concurrent", "2", "--output", str(path))
        assert result.returncode == 0, result.stderr
    assert path.stat().st_mode & 0o777 == 0o600
    entries = yaml.safe_load(path.read_text())
    assert [e["name"] for e in entries] == ["web", "batch"] and entries[0]["key"] != entries[1]["key"]
    assert all(e["key"].startswith(clients.KEY_PREFIX) and len(e["key"]) >= 40 for e in entries)
    listed = run_tool("vlserve", "keys", "check", str(path))
    assert listed.returncode == 0, listed.stderr
    assert clients.key_digest(entries[0]["key"])[:12] in listed.stdout
    assert not any(e["key"] in listed.stdout + listed.stderr for e in entries)
    assert json.loads(json.dumps(clients.front_clients(entries)))[1]["concurrent"] == 2


def test_the_fleet_front_as_render_fleet_writes_it_is_a_valid_haproxy_configuration(tmp_path):
    pem, cert = self_signed(tmp_path)
    (tmp_path / "keys.yml").write_text(yaml.safe_dump(KEY_FILE))
    tree = tmp_path / "fleet"
    result = run_tool(
        "vlserve", "render-fleet", "--out", str(tree), "--backend", "a=127.0.1.1:8100:2", "--backend",
        "b=127.0.1.2:8100", "--tls-pem", str(pem), "--clients", str(tmp_path / "keys.yml"), "--backend-ca", str(cert),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = (tree / units.FLEET_FILES["fleet-haproxy.cfg.j2"].lstrip("/")).read_text()
    servers = [line.split() for line in config.splitlines() if line.strip().startswith("server ")]
    assert [words[1] for words in servers] == ["a", "b"]  # one line each
    assert all("verify" in words and units.FLEET_BACKEND_CA in words for words in servers)
    checked = Front(tree, units.FLEET_FILES["fleet-haproxy.cfg.j2"]).check()
    assert checked.returncode == 0, checked.stderr


def test_only_several_fleet_fronts_are_peers_and_each_needs_its_certificate_and_its_name():
    hostvars = {"f1": {"ansible_host": "10.0.0.1"}, "f2": {"vlserve_fleet_address": "10.0.9.2", "ansible_host": "x"}}
    assert units.fleet_peers(["f1"], hostvars, 8101) == []
    peers = units.fleet_peers(["f1", "f2"], hostvars, 8101)
    assert [(p["name"], p["address"], p["port"]) for p in peers] == [("f1", "10.0.0.1", 8101), ("f2", "10.0.9.2", 8101)]
    options = {"port": 8100, "bind": "0.0.0.0", "max_upload_bytes": 1, "request_timeout_s": 1, "check_interval_s": 1}
    options |= {"peers": peers, "peer_name": "f2", "client_certificate": True}
    assert units.fleet_context([], options)["front"]["peers"]["local"] == "f2"
    for wrong, message in (({"peer_name": "f3"}, "not one of its peers"), ({"client_certificate": False}, "mutual")):
        with pytest.raises(ValueError, match=message):
            units.fleet_context([], options | wrong)
