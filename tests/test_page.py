"""The page at `/`: its files and policy over HTTP, then in headless Chromium against a real worker
with the tiny model: it loads clean, streams an answer with its timing, shows the API's errors, shows
the plan, keeps the API key in the tab, and passes axe-core's accessibility rules.

Screenshots of each state land in tests/artifacts/page/ (docs/images/page.png is one of them).
"""

from __future__ import annotations

import base64
import hashlib
import json
import pathlib
import re
import ssl
import subprocess

import httpx
import pytest
import yaml
from browser import Chromium, chromium_binary

from conftest import REPO, Server, free_port, run_tool
from harness.haproxy import Front, self_signed
from sample_images import chat, image_question, jpeg_bytes, png_bytes
from vlserve.ops import units

ARTIFACTS = REPO / "tests" / "artifacts" / "page"
AXE = REPO / "tests" / "node_modules" / "axe-core" / "axe.min.js"
HOST_PLAN = "xeon-gold-6248r-2s"
TOPOLOGY = (
    REPO / "tests" / "fixtures" / "topologies" / "xeon-avx512bf16-2vcpu-vm.json"
)  # a one-worker front  # a host plan of several workers, shown by the status view


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    facts = REPO / "tests" / "fixtures" / "topologies" / (HOST_PLAN + ".json")
    result = run_tool("vlserve", "plan", "--facts", str(facts), "--json")
    assert result.returncode == 0, result.stderr
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    path.write_text(result.stdout)
    return path


@pytest.fixture(scope="module")
def worker(tiny_model, plan_file):
    server = Server(tiny_model, env={"VLSERVE_PLAN_FILE": str(plan_file)}).wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def guarded_worker(tiny_model):
    """A worker behind an API key, with a small upload limit."""
    env = {
        "VLSERVE_API_KEY": "page-test-key",
        "VLSERVE_MAX_UPLOAD_BYTES": str(64 * 1024),
        "VLSERVE_MAX_BATCH_SIZE": "1",
        "VLSERVE_MAX_QUEUE": "0",  # one request at a time: a second one gets 429
    }
    server = Server(tiny_model, env=env).wait_ready()
    yield server
    server.stop()


@pytest.fixture
def browser(tmp_path):
    if chromium_binary() is None:
        pytest.fail("no chromium: scripts/bootstrap --test installs Debian's chromium")
    with Chromium(tmp_path / "profile") as chromium:
        yield chromium


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pictures")
    (directory / "photo.jpg").write_bytes(jpeg_bytes((640, 480)))
    (directory / "notes.txt").write_text("a shopping list, not an image\n")
    (directory / "big.png").write_bytes(png_bytes((400, 300)) + bytes(96 * 1024))  # over the 64 KiB limit
    return directory


# -- over HTTP ------------------------------------------------------------------------------


def test_the_page_comes_with_a_strict_policy_and_no_inline_script(worker):
    response = httpx.get(worker.url + "/")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert "unsafe" not in policy
    html = response.text
    scripts = re.findall(r"<script\b([^>]*)>(.*?)</script>", html, re.S)
    assert scripts and all('src="/static/' in attributes and not body.strip() for attributes, body in scripts)
    assert not re.search(r"\son[a-z]+\s*=", html) and " style=" not in html  # no inline handlers or styles
    for name, kind in (("page.js", "text/javascript"), ("page.css", "text/css"), ("favicon.svg", "image/svg+xml")):
        asset = httpx.get(worker.url + "/static/" + name)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind), name
        assert asset.headers["content-security-policy"] == policy
    for missing in ("/static/nothing.js", "/static/..%2f..%2fsettings.py", "/static/../app.py"):
        refused = httpx.get(worker.url + missing)
        assert refused.status_code == 404 and "error" in refused.json(), missing


def test_the_page_opens_no_cors_and_changes_nothing_with_get(worker):
    origin = {"Origin": "http://elsewhere.example"}
    preflight = httpx.options(
        worker.url + "/v1/chat/completions", headers=origin | {"Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    for path in ("/", "/status", "/static/page.js"):
        assert "access-control-allow-origin" not in httpx.get(worker.url + path, headers=origin).headers
    assert httpx.get(worker.url + "/v1/chat/completions").status_code == 405


def test_status_shows_the_host_plan_and_this_workers_figures(worker, plan_file):
    plan = json.loads(plan_file.read_text())
    response = httpx.get(worker.url + "/status")
    status = response.json()
    assert status["worker"]["name"] == response.headers["x-vlserve-worker"]
    assert status["state"] == "ready" and status["running_as"]["threads"] >= 1
    shown = status["plan"]
    assert shown["source"] == str(plan_file)
    assert shown["workers"] == plan["workers"]["count"] > 1
    assert {c["name"]: c["value"] for c in shown["choices"]}["dtype"] == plan["model"]["dtype"]
    assert all(choice["why"] for choice in shown["choices"])
    before = status["figures"]["generated_tokens"]
    assert httpx.post(worker.url + "/v1/chat/completions", json=chat("Hi", max_tokens=3), timeout=60).status_code == 200
    figures = httpx.get(worker.url + "/status").json()["figures"]
    assert figures["generated_tokens"] > before and figures["ttft_s"]["p50"] is not None
    assert figures["resident_memory_bytes"] > 0


def test_usage_says_when_the_vision_cache_served_the_image(worker):
    image = png_bytes((96, 64), (10, 200, 90))
    first = httpx.post(worker.url + "/v1/chat/completions", json=image_question(image, max_tokens=2), timeout=60)
    again = httpx.post(
        worker.url + "/v1/chat/completions", json=image_question(image, "And the colour?", max_tokens=2), timeout=60
    )
    assert first.json()["usage"]["images"] == 1 and first.json()["usage"]["images_from_cache"] == 0
    assert again.json()["usage"]["images_from_cache"] == 1 and not again.json()["usage"]["answer_from_cache"]


# -- in Chromium ----------------------------------------------------------------------------


def ask(browser: Chromium, question: str, *files: pathlib.Path, max_tokens: int = 12) -> None:
    if files:
        browser.set_files("#image", *files)
    browser.evaluate(
        "document.getElementById('question').value = %s; document.getElementById('max-tokens').value = %d"
        % (json.dumps(question), max_tokens)
    )
    browser.click("#ask-button")
    browser.wait_for(
        "!document.getElementById('ask-button').disabled && "
        "(document.getElementById('timing').children.length > 0 || "
        "!document.getElementById('error').hidden)",
        what="the answer or an error",
    )


def timing(browser: Chromium) -> dict[str, str]:
    items = browser.evaluate(
        "[...document.querySelectorAll('#timing li')].map(li => [li.firstChild.textContent.trim(), "
        "li.querySelector('strong').textContent])"
    )
    return {label: value for label, value in items}


def test_the_page_loads_with_no_console_errors_and_passes_axe(worker, browser):
    browser.open(worker.url + "/")
    browser.wait_for("document.getElementById('choices').tBodies[0].rows.length > 0", what="the status view")
    assert browser.errors == []
    browser.evaluate(AXE.read_text())  # DevTools evaluation: the page's own policy still forbids inline script
    violations = browser.evaluate(
        "axe.run(document, {runOnly: {type: 'tag', values: ['wcag2a', 'wcag2aa', 'wcag21aa']}})"
        ".then(r => r.violations.map(v => v.id + ': ' + v.nodes.map(n => n.target.join(' ')).join(', ')))"
    )
    assert violations == []
    browser.screenshot(ARTIFACTS / "loaded.png")


TRICKLE = """
const realFetch = window.fetch;
window.fetch = async (...args) => {
  const response = await realFetch(...args);
  if (!(response.headers.get('content-type') || '').startsWith('text/event-stream')) return response;
  const events = (await response.text()).split(/(?<=\\n\\n)/);
  const encoder = new TextEncoder();
  let next = 0;
  const body = new ReadableStream({pull: out => new Promise(done => setTimeout(() => {
    if (next < events.length) out.enqueue(encoder.encode(events[next++])); else out.close();
    done();
  }, 20))});
  return new Response(body, {status: response.status, headers: response.headers});
};
"""


def test_an_image_and_a_question_stream_an_answer_with_its_timing(worker, browser, pictures):
    browser.open(worker.url + "/")
    browser.evaluate(  # count the answer's updates: a streamed answer arrives in pieces
        "window.updates = 0; new MutationObserver(() => window.updates++)"
        ".observe(document.getElementById('answer'), {childList: true, characterData: true, subtree: true})"
    )
    # The stream is handed to the page one server-sent event at a time, 20 ms apart, as a slow network
    # would: a tiny model's short answer would otherwise reach a busy browser whole, in one read.
    browser.evaluate(TRICKLE)
    ask(browser, "What is in this photo?", pictures / "photo.jpg", max_tokens=48)
    assert browser.evaluate("document.getElementById('error').hidden")
    assert browser.text("#answer").strip()
    first = timing(browser)
    tokens = int(first["answer"].split()[0])
    assert tokens < 3 or browser.evaluate("window.updates") > 2, first  # 28 seen here for 48 tokens
    assert first["time to first token"].endswith(" s") and first["speed"].endswith("tokens/s")
    assert int(first["answer"].split()[0]) >= 1 and int(first["prompt"].split()[0]) > 10
    assert first["image"] == "encoded" and first["worker"] == httpx.get(worker.url + "/status").json()["worker"]["name"]
    assert browser.evaluate("!document.getElementById('preview').hidden")
    ask(browser, "What colour is the top left corner?")  # the same image, a second question
    second = timing(browser)  # the first prompt's keys and values up to the question, the image's included
    assert second["image"] == "from an earlier prompt" and second["prompt"].endswith(" reused"), second
    browser.screenshot(ARTIFACTS / "answer.png")
    assert browser.errors == []


# A PNG made in the page (a canvas), handed over as a person's drop or paste would hand it.
MAKE_PICTURE = """new Promise(done => {
  const canvas = document.createElement('canvas'); canvas.width = 96; canvas.height = 64;
  const paint = canvas.getContext('2d'); paint.fillStyle = '%s'; paint.fillRect(0, 0, 96, 64);
  canvas.toBlob(blob => { const t = new DataTransfer(); t.items.add(new File([blob], 'made.png', {type: 'image/png'}));
    window.madeFiles = t; done(true); }, 'image/png');
})"""


@pytest.mark.parametrize(
    "hand_over, colour",  # a colour each: the second test must not find the first one's image in the cache
    [
        (
            "document.getElementById('drop').dispatchEvent("
            "new DragEvent('drop', {dataTransfer: window.madeFiles, bubbles: true, cancelable: true}))",
            "#3366cc",
        ),
        (
            "document.dispatchEvent(new ClipboardEvent('paste', {clipboardData: window.madeFiles, bubbles: true}))",
            "#cc6633",
        ),
    ],
    ids=["dropped", "pasted"],
)
def test_a_dropped_or_pasted_image_is_the_one_asked_about(worker, browser, hand_over, colour):
    browser.open(worker.url + "/")
    browser.evaluate(MAKE_PICTURE % colour)
    browser.evaluate(hand_over)
    assert browser.evaluate("document.getElementById('image').files[0].name") == "made.png"
    assert browser.evaluate("!document.getElementById('preview').hidden")
    ask(browser, "What colour is it?")
    assert browser.evaluate("document.getElementById('error').hidden") and timing(browser)["image"] == "encoded"
    assert browser.errors == []


def test_a_file_that_is_no_image_shows_the_apis_400_message(worker, browser, pictures):
    browser.open(worker.url + "/")
    ask(browser, "What is this?", pictures / "notes.txt")
    shown = browser.text("#error")
    body = image_question((pictures / "notes.txt").read_bytes(), "What is this?", mime="text/plain", max_tokens=12)
    api = httpx.post(worker.url + "/v1/chat/completions", json=body | {"stream": True}, timeout=60)
    assert api.status_code == 400
    # The message is the API's own; the ID is the page's request's, the one its worker logged.
    assert re.fullmatch(r"HTTP 400: %s · request [0-9a-f]{32}" % re.escape(api.json()["error"]["message"]), shown)
    assert ("request %s:" % shown.rsplit(" ", 1)[1]) in pathlib.Path(worker.log.name).read_text()
    assert browser.text("#answer") == ""
    assert browser.evaluate("getComputedStyle(document.getElementById('preview')).display") == "none"  # no preview
    browser.screenshot(ARTIFACTS / "error-400.png")
    assert httpx.get(worker.url + "/readyz").status_code == 200  # and the worker lives on


def test_the_status_view_shows_the_plans_workers_and_dtypes(worker, browser, plan_file):
    plan = json.loads(plan_file.read_text())
    browser.open(worker.url + "/")
    summary = browser.wait_for("document.getElementById('plan-summary').textContent", what="the plan")
    assert summary.startswith("%d workers × %d threads" % (plan["workers"]["count"], plan["worker_list"][0]["threads"]))
    rows = browser.evaluate(
        "[...document.querySelectorAll('#choices tbody tr')].map(r => [...r.cells].map(c => c.textContent))"
    )
    assert ["dtype", plan["model"]["dtype"], plan["model"]["why"]] in rows
    state = browser.text("#status-line")
    assert state.startswith("State: ready")
    figures = browser.evaluate("document.getElementById('figures').textContent")
    assert "time to first token" in figures and "GiB" in figures
    browser.screenshot(ARTIFACTS / "status.png")


def test_the_api_key_stays_in_the_tab_and_the_front_refusals_are_shown(guarded_worker, browser, pictures):
    browser.open(guarded_worker.url + "/")
    ask(browser, "Hello?")
    assert browser.text("#error").startswith("HTTP 401: missing or wrong API key")
    browser.screenshot(ARTIFACTS / "error-401.png")
    browser.evaluate("document.getElementById('key-box').open = true")
    browser.set_files("#image", pictures / "photo.jpg")
    browser.evaluate(
        "const k = document.getElementById('api-key'); k.value = 'page-test-key';k.dispatchEvent(new Event('input'))"
    )
    ask(browser, "Hello?")
    assert browser.evaluate("document.getElementById('error').hidden") and browser.text("#answer").strip()
    assert browser.evaluate("sessionStorage.getItem('vlserve.apiKey')") == "page-test-key"
    assert browser.evaluate("document.cookie") == ""
    browser.open(guarded_worker.url + "/")  # a reload in the same tab keeps it
    assert browser.evaluate("document.getElementById('api-key').value") == "page-test-key"
    ask(browser, "And this one?", pictures / "big.png")
    assert re.fullmatch(r"HTTP 413: the request body is over \d+ bytes · request [0-9a-f]{32}", browser.text("#error"))
    browser.screenshot(ARTIFACTS / "error-413.png")


def test_a_full_worker_is_shown_as_429_with_its_retry_after(guarded_worker, browser, pictures):
    key = {"Authorization": "Bearer page-test-key"}
    busy = chat("Count to a thousand.", max_tokens=3000, ignore_eos=True, stream=True)
    # The page is loaded before the slot is taken, so only the question comes while it is held.
    browser.open(guarded_worker.url + "/")
    browser.evaluate("sessionStorage.setItem('vlserve.apiKey', 'page-test-key')")
    browser.open(guarded_worker.url + "/")
    browser.wait_for("document.getElementById('choices').tBodies[0].rows.length > 0", what="the status view")
    with (
        httpx.Client(timeout=60) as client,
        client.stream("POST", guarded_worker.url + "/v1/chat/completions", json=busy, headers=key) as occupying,
    ):
        lines = occupying.iter_lines()  # kept: a dropped iterator closes the response, and the worker cancels
        next(lines)  # submitted: waiting, in its prefill or running, it holds the only slot; the queue is 0 long
        ask(browser, "Anyone there?", pictures / "photo.jpg")
        shown = browser.text("#error")
        browser.screenshot(ARTIFACTS / "error-429.png")
    assert re.fullmatch(r"HTTP 429: .+ \(retry after \d+ s\) · request [0-9a-f]{32}", shown), shown


@pytest.fixture
def tls_front(worker, tmp_path):
    """The worker behind its host front as the roles write it: TLS, and one client's key."""
    pem, cert = self_signed(tmp_path)
    key = "vls-page-" + "p" * 40
    (tmp_path / "keys.yml").write_text(yaml.safe_dump([{"name": "page", "key": key}]))
    port = free_port()
    rendered = run_tool(
        "vlserve", "render-units", "--out", str(tmp_path / "tree"), "--facts", str(TOPOLOGY),
        "--max-workers", "1", "--base-port", str(worker.port), "--front-port", str(port), "--front-bind", "127.0.0.1",
        "--clients", str(tmp_path / "keys.yml"), "--tls-pem", str(pem),
    )  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    front = Front(tmp_path / "tree", units.CONFIG_FILES["haproxy.cfg.j2"])
    url = "https://127.0.0.1:%d" % port
    front.start(url + "/readyz", ca=ssl.create_default_context(cafile=str(cert)))
    # Chromium trusts this front's key alone (its SPKI digest), as a client would trust the CA.
    spki = subprocess.run(
        ["openssl", "x509", "-pubkey", "-noout", "-in", str(cert)], check=True, capture_output=True
    ).stdout
    der = subprocess.run(["openssl", "pkey", "-pubin", "-outform", "der"], input=spki, check=True, capture_output=True)
    pin = base64.b64encode(hashlib.sha256(der.stdout).digest()).decode()
    yield {"url": url, "key": key, "flags": ("--ignore-certificate-errors-spki-list=" + pin,)}
    front.stop()


def test_the_page_answers_through_a_tls_front_with_a_clients_key(tls_front, pictures, tmp_path):
    with Chromium(tmp_path / "profile", flags=tls_front["flags"]) as browser:
        browser.open(tls_front["url"] + "/")
        ask(browser, "Hello?")
        assert browser.text("#error").startswith("HTTP 401: missing or wrong API key")
        browser.evaluate("document.getElementById('key-box').open = true")
        browser.evaluate(
            "const k = document.getElementById('api-key'); k.value = %s; k.dispatchEvent(new Event('input'))"
            % json.dumps(tls_front["key"])
        )
        ask(browser, "What is in this photo?", pictures / "photo.jpg")
        assert browser.evaluate("document.getElementById('error').hidden"), browser.text("#error")
        assert browser.text("#answer").strip() and timing(browser)["worker"]
        assert browser.evaluate("location.protocol") == "https:"
        browser.screenshot(ARTIFACTS / "over-tls.png")
        assert browser.errors == [] or all("401" in error for error in browser.errors), browser.errors
