"""Chat template rendering and the assistant loss mask.

Convention (fixed once, tested per template): ``loss_mask`` is aligned with ``input_ids`` and marks the
tokens a model must *produce*: ``loss_mask[t] == 1`` iff token ``t`` belongs to an assistant turn (its
content and the end-of-turn token, e.g. ``<|im_end|>`` or ``<|eot_id|>``; not the whitespace a template
puts after that token, which is never generated). The prediction of token ``t`` is made at position
``t-1``, so a next-token loss at position ``t`` (label ``input_ids[t+1]``) is weighted by
``loss_mask[t+1]``: see :func:`shift_labels`. (EAGLE's code leaves this off by one in places; EAGLE #325.)

Tokenisation is done per segment, split at the boundaries of assistant turns: the prompt before an
assistant turn is tokenised exactly as it is at inference (rendered with ``add_generation_prompt``),
and the answer as the tokens the model would emit after it.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from data.errors import UserError

TRUNCATION_POLICIES = ("turn", "hard", "drop")


def _render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                            "set tokenizer.chat_template (a Jinja string) or use a chat/instruct model") from None
        raise UserError(f"chat template failed on this conversation: {e}") from None


def render_segments(tokenizer: Any, messages: Sequence[dict]) -> list[tuple[str, bool]]:
    """Split the rendered conversation into ``(text, is_assistant)`` segments whose concatenation is the full render."""
    full = _render(tokenizer, messages, add_generation_prompt=False)
    segments: list[tuple[str, bool]] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        if i == 0:
            raise UserError("conversation starts with an assistant turn; normalise it first")
        prompt = _render(tokenizer, messages[:i], add_generation_prompt=True)
        upto = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not (full.startswith(upto) and upto.startswith(prompt) and len(prompt) >= cursor):
            raise UserError(f"chat template of {getattr(tokenizer, 'name_or_path', 'tokenizer')!r} is not prefix-stable "
                            "(rendering a prefix of the chat changes earlier text); loss masks need a template that only appends")
        end = len(upto.rstrip(" \t\r\n"))  # whitespace after the end-of-turn token is never generated
        if len(prompt) > cursor:
            segments.append((full[cursor: len(prompt)], False))
        segments.append((full[len(prompt): end], True))
        cursor = end
    if full[cursor:]:
        segments.append((full[cursor:], False))
    return segments


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], max_length: int | None = None,
                          truncation: str = "turn") -> dict[str, list[int]] | None:
    """Return ``{"input_ids", "loss_mask"}`` for a conversation, or None when it is dropped.

    Over-long conversations (``max_length``): ``turn`` keeps the longest prefix that ends with a whole
    assistant turn (a hard cut if even the first answer does not fit); ``hard`` cuts at max_length;
    ``drop`` drops the conversation.
    """
    if truncation not in TRUNCATION_POLICIES:
        raise UserError(f"truncation={truncation!r}: use one of {', '.join(TRUNCATION_POLICIES)}")
    ids: list[int] = []
    mask: list[int] = []
    turn_ends: list[int] = []  # token index just after each assistant segment
    for text, is_asst in render_segments(tokenizer, messages):
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += toks
        mask += [int(is_asst)] * len(toks)
        if is_asst:
            turn_ends.append(len(ids))
    if max_length is not None and len(ids) > max_length:
        if truncation == "drop":
            return None
        cut = max([e for e in turn_ends if e <= max_length], default=max_length) if truncation == "turn" else max_length
        ids, mask = ids[:cut], mask[:cut]
    if not any(mask):
        return None
    return {"input_ids": ids, "loss_mask": mask}


def shift_labels(input_ids: torch.Tensor, loss_mask: torch.Tensor, ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels and weights for a next-token loss at every position.

    input_ids, loss_mask: [..., T]. Returns labels [..., T] with ``labels[t] = input_ids[t+1]`` and weights
    [..., T] with ``weights[t] = loss_mask[t+1]``; the last position has label ``ignore_index`` and weight 0.
    """
    labels = torch.full_like(input_ids, ignore_index)
    labels[..., :-1] = input_ids[..., 1:]
    weights = torch.zeros_like(loss_mask)
    weights[..., :-1] = loss_mask[..., 1:]
    labels = labels.masked_fill(weights == 0, ignore_index)
    return labels, weights
