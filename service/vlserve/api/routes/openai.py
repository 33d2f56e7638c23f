"""OpenAI-compatible endpoints: /v1/models and /v1/chat/completions (plain and streamed)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from vlserve.api.dependencies import ReadySubmitter, SettingsDep, authorize
from vlserve.api.errors import APIError, from_engine_error
from vlserve.api.protocol import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    Delta,
    ModelCard,
    ModelList,
    UsageInfo,
    completion_id,
)
from vlserve.api.submission import Generation, Submitter, usage_info
from vlserve.runtime.images import decode_data_uri, fetch_image_url
from vlserve.settings import Settings

router = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])


@router.get("/models")
async def list_models(request: Request, settings: SettingsDep) -> ModelList:
    return ModelList(
        data=[
            ModelCard(
                id=settings.server.served_model_name,
                created=int(request.app.state.started),
                max_model_len=settings.limits.max_context_tokens,
            )
        ]
    )


@router.post("/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, submitter: ReadySubmitter):
    prompt = await submitter.prepare(await conversation(body, submitter.settings, submitter))
    generation = submitter.generate(
        prompt,
        max_tokens=body.requested_max_tokens(),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_strings(),
        ignore_eos=body.ignore_eos,
        trace=request.state.trace,
    )
    model_name = submitter.settings.server.served_model_name
    if not body.stream:
        text, reason, usage = await generation.collect(request)
        return ChatCompletion(
            model=model_name,
            choices=[Choice(message=AssistantMessage(content=text), finish_reason=reason)],
            usage=usage_info(usage),
        )
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return StreamingResponse(
        stream_chunks(generation, model_name, include_usage, request.state.trace.request_id),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def conversation(body: ChatCompletionRequest, settings: Settings, submitter: Submitter):
    """The engine's messages, as a function for the preparation threads: image bytes are fetched
    here (data: URIs decoded, http(s) URLs fetched from allowed hosts), pixels decoded there."""
    limits = settings.limits
    count = sum(1 for m in body.messages if not isinstance(m.content, str) for p in m.content if p.type == "image_url")
    if count > limits.max_images_per_request:
        raise APIError(
            400,
            "%d images in one request; the limit is %d" % (count, limits.max_images_per_request),
            "invalid_request_error",
            param="messages",
            code="too_many_images",
        )
    raw: list[dict[str, Any]] = []
    for m_index, message in enumerate(body.messages):
        if isinstance(message.content, str):
            raw.append({"role": message.role, "content": message.content})
            continue
        parts = []
        for p_index, part in enumerate(message.content):
            if part.type == "text":
                parts.append({"type": "text", "text": part.text})
                continue
            param = "messages.%d.content.%d.image_url" % (m_index, p_index)
            url = part.image_url.url
            if url.startswith("data:"):
                data = decode_data_uri(url, param)
            else:
                data = await fetch_image_url(
                    url, limits.image_url_hosts, limits.image_fetch_timeout_s, limits.max_upload_bytes, param
                )
            parts.append({"type": "image", "bytes": data, "param": param})
        raw.append({"role": message.role, "content": parts})

    def messages() -> list[dict[str, Any]]:
        built = []
        for message in raw:
            content = message["content"]
            if not isinstance(content, str):
                content = [
                    {"type": "image", "image": submitter.decode_image(part["bytes"], part["param"])}
                    if part["type"] == "image"
                    else part
                    for part in content
                ]
            built.append({"role": message["role"], "content": content})
        return built

    return messages


async def stream_chunks(generation: Generation, model_name: str, include_usage: bool, request_id: str):
    """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`; an error names the request."""
    chunk_id, created = completion_id(), int(time.time())

    def event(choices: list[ChunkChoice], usage: UsageInfo | None = None) -> str:
        chunk = ChatCompletionChunk(id=chunk_id, created=created, model=model_name, choices=choices, usage=usage)
        return "data: %s\n\n" % chunk.model_dump_json(exclude_none=False)

    yield event([ChunkChoice(delta=Delta(role="assistant", content=""))])
    async for kind, payload in generation.events():
        if kind == "text":
            yield event([ChunkChoice(delta=Delta(content=payload))])
        elif kind == "finish":
            reason, usage = payload
            yield event([ChunkChoice(delta=Delta(), finish_reason=reason)])
            if include_usage:
                yield event([], usage_info(usage))
        else:
            error = from_engine_error(payload)
            error.param = None  # the stream's error names no request field
            yield "data: %s\n\n" % error.body(request_id).model_dump_json()
    yield "data: [DONE]\n\n"
