// vlserve's page: ask about an image through the API (streamed), and watch this worker's status.
// No framework and no build step: the file is served as it is, from the package.
"use strict";

const KEY_STORAGE = "vlserve.apiKey"; // sessionStorage: this tab only, never a cookie
const STATUS_EVERY_MS = 3000;

const $ = (id) => document.getElementById(id);
let picked = null; // the File to ask about
let running = null; // the AbortController of the request in flight

// --- the image: picked, dropped or pasted -------------------------------------------------

function pick(file) {
  picked = file || null;
  const preview = $("preview");
  if (preview.src) URL.revokeObjectURL(preview.src);
  if (picked && picked.type.startsWith("image/")) {
    preview.src = URL.createObjectURL(picked);
    preview.hidden = false;
  } else {
    preview.removeAttribute("src");
    preview.hidden = true;
  }
}

function setUpImageInput() {
  const input = $("image");
  const drop = $("drop");
  input.addEventListener("change", () => pick(input.files[0]));
  drop.addEventListener("dragover", (event) => {
    event.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (event) => {
    event.preventDefault();
    drop.classList.remove("over");
    const file = event.dataTransfer.files[0];
    if (file) {
      input.files = event.dataTransfer.files;
      pick(file);
    }
  });
  document.addEventListener("paste", (event) => {
    const file = [...event.clipboardData.files].find((f) => f.type.startsWith("image/"));
    if (file) {
      const transfer = new DataTransfer();
      transfer.items.add(file);
      input.files = transfer.files;
      pick(file);
    }
  });
}

// --- asking ------------------------------------------------------------------------------

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error("cannot read " + file.name));
    reader.readAsDataURL(file);
  });
}

function headers() {
  const result = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) result.Authorization = "Bearer " + key;
  return result;
}

function showError(message) {
  const box = $("error");
  box.textContent = message;
  box.hidden = false;
}

function timingItem(label, value) {
  const item = document.createElement("li");
  const strong = document.createElement("strong");
  strong.textContent = value;
  item.append(label + " ", strong);
  $("timing").append(item);
}

// What an operator needs to find a failed request in the fronts' logs and the workers' journal.
function withRequestId(text, id) {
  return id ? text + " · request " + id : text;
}

// The API's own error, as it gave it: {"error": {"message": ...}}, with Retry-After where it says,
// and the request's ID (the body's, or the header a front set on its own refusals).
async function apiError(response) {
  let message = response.statusText || "error";
  let id = response.headers.get("X-Request-Id");
  try {
    const body = await response.json();
    if (body && body.error && body.error.message) message = body.error.message;
    if (body && body.error && body.error.request_id) id = body.error.request_id;
  } catch (ignored) {
    // not JSON (a proxy's page): the status line is all there is
  }
  let text = "HTTP " + response.status + ": " + message;
  const retry = response.headers.get("Retry-After");
  if (retry) text += " (retry after " + retry + " s)";
  return withRequestId(text, id);
}

function showTiming(t, usage, worker) {
  const list = $("timing");
  list.replaceChildren();
  if (t.first !== null) timingItem("time to first token", ((t.first - t.sent) / 1000).toFixed(2) + " s");
  if (usage) {
    const decode = (t.end - (t.first ?? t.end)) / 1000;
    if (usage.completion_tokens > 1 && decode > 0) {
      timingItem("speed", ((usage.completion_tokens - 1) / decode).toFixed(1) + " tokens/s");
    }
    const reused = usage.prompt_tokens_details?.cached_tokens ?? 0;
    timingItem("prompt", usage.prompt_tokens + " tokens" + (reused ? ", " + reused + " reused" : ""));
    timingItem("answer", usage.completion_tokens + " tokens");
    if (usage.answer_from_cache) {
      timingItem("answer", "from the result cache");
    } else if (usage.images) {
      const from = reused ? "from an earlier prompt" : "from the vision cache";
      timingItem("image", usage.images_from_cache ? from : "encoded");
    }
  }
  timingItem("total", ((t.end - t.sent) / 1000).toFixed(2) + " s");
  if (worker) timingItem("worker", worker);
}

async function ask(event) {
  event.preventDefault();
  const question = $("question").value.trim();
  if (!question) {
    showError("Type a question first.");
    return;
  }
  $("error").hidden = true;
  $("answer").textContent = "";
  $("timing").replaceChildren();
  const content = [];
  try {
    if (picked) content.push({ type: "image_url", image_url: { url: await readAsDataURL(picked) } });
  } catch (error) {
    showError(error.message);
    return;
  }
  content.push({ type: "text", text: question });
  const body = {
    messages: [{ role: "user", content }],
    max_tokens: Number($("max-tokens").value) || 256,
    stream: true,
    stream_options: { include_usage: true },
  };
  running = new AbortController();
  $("ask-button").disabled = true;
  $("stop-button").disabled = false;
  const t = { sent: performance.now(), first: null, end: null };
  let usage = null;
  let worker = null;
  try {
    const response = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify(body),
      signal: running.signal,
    });
    worker = response.headers.get("X-Vlserve-Worker");
    if (!response.ok) {
      showError(await apiError(response));
      return;
    }
    usage = await readStream(response, t);
  } catch (error) {
    if (error.name === "AbortError") showError("Stopped.");
    else showError("The request failed: " + error.message);
  } finally {
    t.end = performance.now();
    running = null;
    $("ask-button").disabled = false;
    $("stop-button").disabled = true;
    if (usage || t.first !== null) showTiming(t, usage, worker);
    refreshStatus();
  }
}

// Server-sent events in OpenAI's chunk format; returns the usage of the last chunk.
async function readStream(response, t) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  const answer = $("answer");
  let buffered = "";
  let usage = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffered += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffered.indexOf("\n\n")) >= 0) {
      const lines = buffered.slice(0, end).split("\n");
      buffered = buffered.slice(end + 2);
      for (const line of lines) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return usage;
        const chunk = JSON.parse(data);
        if (chunk.error) {
          showError(withRequestId(chunk.error.message, chunk.error.request_id));
          continue;
        }
        if (chunk.usage) usage = chunk.usage;
        const text = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
        if (text) {
          if (t.first === null) t.first = performance.now();
          answer.textContent += text;
        }
      }
    }
  }
  return usage;
}

// --- the status view ---------------------------------------------------------------------

function seconds(value) {
  if (value === null || value === undefined) return "–";
  return value < 1 ? (value * 1000).toFixed(0) + " ms" : value.toFixed(2) + " s";
}

function ratio(value) {
  return value === null || value === undefined ? "no lookups yet" : (value * 100).toFixed(0) + "%";
}

function fillFacts(list, facts) {
  list.replaceChildren();
  for (const [name, value] of facts) {
    const term = document.createElement("dt");
    term.textContent = name;
    const detail = document.createElement("dd");
    detail.textContent = value;
    list.append(term, detail);
  }
}

function showStatus(status) {
  const line = $("status-line");
  const ready = status.state === "ready";
  const pending = status.background_steps_pending;
  line.replaceChildren();
  const state = document.createElement("span");
  state.className = ready ? "state-ready" : "state-busy";
  state.textContent = status.state;
  line.append("State: ", state);
  if (ready && pending) line.append(" (background work pending: " + pending + " steps)");
  $("model-line").textContent = status.worker.model + " on " + status.worker.name;
  const running = status.running_as || {};
  fillFacts($("worker"), [
    ["worker", status.worker.name + " (pid " + status.worker.pid + ")"],
    ["up for", Math.round(status.worker.uptime_s) + " s"],
    ["weights", running.dtype ? running.dtype + ", quantize " + running.quantize : "loading"],
    ["threads", running.threads ?? "–"],
    ["kernels", running.kernels ?? "–"],
  ]);
  const plan = status.plan;
  const rows = $("choices").tBodies[0];
  rows.replaceChildren();
  if (plan) {
    $("plan-summary").textContent =
      plan.workers + " worker" + (plan.workers === 1 ? "" : "s") + " × " + plan.threads + " threads; this is worker " +
      plan.worker_index + " on CPUs " + plan.cpus + " (plan from " + plan.source + "). Workers: " + plan.workers_why + ".";
    for (const choice of plan.choices) {
      const row = rows.insertRow();
      row.insertCell().textContent = choice.name;
      row.insertCell().textContent = String(choice.value);
      row.insertCell().textContent = choice.why;
    }
  } else {
    $("plan-summary").textContent = ready
      ? "No plan: the sizing engine found no worker that fits this process's share of the host."
      : "The worker is " + status.state + ": its plan shows once the model is loaded.";
  }
  const f = status.figures;
  fillFacts($("figures"), [
    ["queue", f.queue_depth + " waiting, " + f.running + " running"],
    ["time to first token", "p50 " + seconds(f.ttft_s.p50) + ", p95 " + seconds(f.ttft_s.p95)],
    ["time per token", "p50 " + seconds(f.tpot_s.p50) + ", p95 " + seconds(f.tpot_s.p95)],
    ["prefix cache hits", ratio(f.cache_hit_ratio.prefix)],
    ["vision cache hits", ratio(f.cache_hit_ratio.vision)],
    ["result cache hits", ratio(f.cache_hit_ratio.result)],
    ["tokens generated", String(f.generated_tokens)],
    ["resident memory", (f.resident_memory_bytes / 2 ** 30).toFixed(2) + " GiB"],
  ]);
}

async function refreshStatus() {
  try {
    const response = await fetch("/status", { headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(await apiError(response));
    showStatus(await response.json());
  } catch (error) {
    $("status-line").textContent = "Cannot reach the worker's status: " + error.message;
  }
}

// --- start -------------------------------------------------------------------------------

function start() {
  const key = $("api-key");
  key.value = sessionStorage.getItem(KEY_STORAGE) || "";
  if (key.value) $("key-box").open = true;
  key.addEventListener("input", () => sessionStorage.setItem(KEY_STORAGE, key.value));
  setUpImageInput();
  $("ask-form").addEventListener("submit", ask);
  $("stop-button").addEventListener("click", () => running && running.abort());
  refreshStatus();
  setInterval(refreshStatus, STATUS_EVERY_MS);
}

start();
