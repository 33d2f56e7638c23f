"""/v1/ask: one image and one question as a multipart form, one answer as JSON (for curl)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, File, Form, Request, UploadFile

from vlserve.api.dependencies import ReadySubmitter, authorize
from vlserve.api.protocol import AskResponse
from vlserve.api.submission import usage_info

router = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])


@router.post("/ask")
async def ask(
    request: Request,
    submitter: ReadySubmitter,
    *,
    image: Annotated[UploadFile, File(description="the image")],
    question: Annotated[str, Form(min_length=1)],
    max_tokens: Annotated[int | None, Form(ge=1)] = None,
    temperature: Annotated[float | None, Form(ge=0.0, le=2.0)] = None,
) -> AskResponse:
    data = await image.read()

    def messages():
        picture = submitter.decode_image(data, "image")
        return [{"role": "user", "content": [{"type": "image", "image": picture}, {"type": "text", "text": question}]}]

    prompt = await submitter.prepare(messages)
    generation = submitter.generate(prompt, max_tokens=max_tokens, temperature=temperature, trace=request.state.trace)
    text, reason, usage = await generation.collect(request)
    return AskResponse(
        answer=text,
        finish_reason=reason,
        model=submitter.settings.server.served_model_name,
        usage=usage_info(usage),
    )
