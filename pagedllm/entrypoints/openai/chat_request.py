"""The one conversion from a chat-shaped API request to what the engine runs: prompt token ids (the chat
template over messages and tools), ``SamplingParams`` (sampling fields, structured outputs, the tool choice's
grammar, the reasoning gate) and the ``ToolPlan`` that reads the output back.

Chat completions arrive here as they are; the Responses API (``serving_responses.py``) and Anthropic's Messages
API (``serving_messages.py``) first translate their wire shape into a ``ChatCompletionRequest``, so every
endpoint builds prompts and parameters the same way.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pagedllm.entrypoints.openai.errors import OpenAIError, param_of
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.reasoning_parsers import ReasoningParser
from pagedllm.entrypoints.openai.tool_parsers import ToolParser
from pagedllm.entrypoints.openai.tools import TOOL_CHATML_TEMPLATE, ToolPlan, plan_tools, template_has_tools
from pagedllm.multimodal.chat import load_images, parse_chat_messages
from pagedllm.multimodal.media import MediaPolicy
from pagedllm.sampling_params import SamplingParams


@dataclass
class PreparedChat:
    """A chat request ready for the engine, and what reads its output back."""

    token_ids: list[int]
    params: SamplingParams
    plan: ToolPlan
    tool_parser: ToolParser
    reasoning_parser: ReasoningParser | None
    cache_salt: str | None = None
    # What the engine is given: the token ids, and for images the prompt text and the processed pictures.
    prompt: dict[str, Any] = field(default_factory=dict)
    lora_request: Any = None  # the LoRA adapter the request's model names (lora.request.AdapterRef), or None

    def __post_init__(self) -> None:
        if not self.prompt:
            self.prompt = {"prompt_token_ids": self.token_ids}


class ChatConverter:
    def __init__(self, tokenizer: Any, processor: Any, check_length: Any, tool_parser: ToolParser,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.check_length = check_length  # OpenAIServing.check_length: (num_prompt, max_tokens, where) -> max
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, chat_template: str | None = None,
               chat_template_kwargs: dict[str, Any] | None = None,
               tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Messages → prompt token ids via the tokenizer's chat template (an image counts as its one placeholder
        token here; ``prepare`` expands it through the model's processor)."""
        text, _ = self.render_text(messages, add_generation_prompt, continue_final_message, chat_template,
                                   chat_template_kwargs, tools)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_text(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template: str | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    tools: list[dict[str, Any]] | None = None) -> tuple[str, list[Any]]:
        """Messages → (the prompt text via the chat template, the image references of its content parts)."""
        if not messages:
            raise OpenAIError("messages: must not be empty", param="messages")
        mc = self.processor.model_config
        try:
            conv, images = parse_chat_messages(messages, mc.is_multimodal, mc.name)
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
        conv = [m if m.get("content") is not None else {**m, "content": ""} for m in conv]
        uses_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in conv)
        if uses_tools and chat_template is None and not template_has_tools(self.tokenizer.chat_template):
            chat_template = TOOL_CHATML_TEMPLATE  # the model's template would drop the tools silently
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, chat_template=chat_template,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, **extra)
        except Exception as e:  # template errors are the client's input problem
            raise OpenAIError(f"messages: could not apply the chat template: {e}", param="messages") from None
        return text, images

    def _multimodal_prompt(self, text: str, image_refs: list[Any]) -> dict[str, Any]:
        """Images loaded under the server's media policy and run through the model's processor (blocking: called
        in a worker thread) → an engine prompt with its placeholders expanded."""
        mc = self.processor.model_config
        images = load_images(image_refs, MediaPolicy(mc.allowed_local_media_path, mc.allowed_media_domains))
        _, token_ids, features = self.processor.multimodal_inputs(
            {"prompt": text, "multi_modal_data": {"image": images}}, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": token_ids, "mm_features": features}

    async def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        """Prompt ids (images loaded and processed off the event loop) + sampling parameters + tool plan; raises
        OpenAIError (400) naming the field."""
        try:
            plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        text, image_refs = self.render_text(req.messages, req.add_generation_prompt, req.continue_final_message,
                                            req.chat_template, req.chat_template_kwargs, plan.tools or None)
        if image_refs:
            try:
                prompt = await asyncio.to_thread(self._multimodal_prompt, text, image_refs)
            except ValueError as e:
                raise OpenAIError(str(e), param="messages") from None
            token_ids = prompt["prompt_token_ids"]
        else:
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompt = {"prompt_token_ids": token_ids}
        max_tokens = self.check_length(len(token_ids), req.requested_max_tokens(), "messages")
        try:
            params = req.to_sampling_params(max_tokens)
            if plan.constraint is not None:
                if params.structured_outputs is not None:
                    raise ValueError("tool_choice: a named or required tool choice cannot be combined with "
                                     "response_format or structured_outputs")
                params.structured_outputs = plan.constraint
            params.reasoning = self._reasoning_gate(req, params)
            self.processor.validate_params(params, len(token_ids))
        except ValueError as e:
            raise OpenAIError(str(e), param=param_of(str(e))) from None
        return PreparedChat(token_ids, params, plan, self.tool_parser, self.reasoning_parser, req.cache_salt,
                            prompt)

    def _reasoning_gate(self, req: ChatCompletionRequest, params: SamplingParams) -> Any:
        """The engine follows the thinking only where it must: a grammar waits for the answer, or a budget."""
        budget = req.thinking_token_budget
        if self.reasoning_parser is None:
            if budget is not None:
                raise ValueError("thinking_token_budget: needs a reasoning model served with --reasoning-parser")
            return None
        if budget is None and params.structured_outputs is None:
            return None
        return self.reasoning_parser.engine_params(self.tokenizer, budget)
