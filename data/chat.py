"""Chat template rendering and the assistant loss mask.

Convention (fixed once, tested per template): ``loss_mask`` is aligned with ``input_ids`` and marks the
tokens a model must *produce*: ``loss_mask[t] == 1`` iff token ``t`` belongs to an assistant turn (its
content and the end-of-turn token, e.g. ``<|im_end|>`` or ``<|eot_id|>``; not the whitespace a template
puts after that token, which is never generated). The prediction of token ``t`` is made at position
``t-1``, so a next-token loss at position ``t`` (label ``input_ids[t+1]``) is weighted by
``loss_mask[t+1]``: see :func:`shift_labels`. (EAGLE's code leaves this off by one in places; EAGLE #325.)

The whole conversation is rendered once and tokenised once (with character offsets), so templates
that rewrite earlier turns when a turn is added work as well as those that only append: Qwen3 (the
empty think block only on the last answer, earlier reasoning stripped), reasoning distills (reasoning
stripped from every answer) and templates that move the system prompt (Mistral's v3, onto the last user
turn). Each assistant turn is located in the render, in order, searching forward from the previous one:
by the template's ``{% generation %}`` blocks where it has them (``return_assistant_tokens_mask`` in
transformers), else from where its generation prompt ends (the text a generation prompt writes after a
user turn, read from a probe render) to the message's content as the template writes it (verbatim,
trimmed, or its answer after ``</think>``). What lies between the two is the model's too when it is
whitespace (Mistral's space after ``[/INST]``) or a think block (Qwen3's, empty or holding the reasoning
of the last answer); then the end-of-turn marker the template writes after an answer (also read from a
probe render). A token is masked when its characters overlap an answer span, so the tokens before the
last answer are exactly its prompt at inference (``add_generation_prompt``; tested per template).
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from data.errors import UserError

TRUNCATION_POLICIES = ("turn", "hard", "drop")
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
_PROBE = "\x00answer\x00"  # content no real answer holds: where the probe's answer ends, its end-of-turn marker starts


def render(tokenizer: Any, messages: Sequence[dict], add_generation_prompt: bool = False,
           chat_template_kwargs: dict | None = None) -> str:
    """The template's text for ``messages``; ``chat_template_kwargs`` (e.g. ``{"enable_thinking": False}``) go to the template."""
    try:
        return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                             **dict(chat_template_kwargs or {}))
    except ValueError as e:
        if getattr(tokenizer, "chat_template", None) is None:
            raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template; "
                            "set tokenizer.chat_template (a Jinja string) or use a chat/instruct model") from None
        raise UserError(f"chat template failed on this conversation: {e}") from None
    except Exception as e:  # a template's raise_exception (alternating roles, system role not supported, ...)
        if type(e).__name__ == "TemplateError":
            raise UserError(f"chat template of {getattr(tokenizer, 'name_or_path', 'tokenizer')!r} refused this "
                            f"conversation: {e}") from None
        raise


_MARKS_CACHE: dict[tuple, tuple[str, str]] = {}
_QUESTION = "\x01question\x01"


def template_marks(tokenizer: Any, chat_template_kwargs: dict | None = None) -> tuple[str, str]:
    """``(prompt_tail, end_of_turn)`` of a template, read from one-turn probe renders (cached per template and kwargs):
    the text a generation prompt writes after a user turn's content (``<|im_end|>\\n<|im_start|>assistant\\n``,
    ``[/INST]``), and the text written right after an answer (``<|im_end|>``, ``<|eot_id|>``, ``</s>``; trailing
    whitespace excluded)."""
    template = getattr(tokenizer, "chat_template", None)
    key = (str(template), getattr(tokenizer, "eos_token", None), repr(sorted((chat_template_kwargs or {}).items())))
    if key not in _MARKS_CACHE:
        user = [{"role": "user", "content": _QUESTION}]
        probe = render(tokenizer, user + [{"role": "assistant", "content": _PROBE}], chat_template_kwargs=chat_template_kwargs)
        eot = probe[probe.rindex(_PROBE) + len(_PROBE):].rstrip(" \t\r\n") if _PROBE in probe else ""
        gen = render(tokenizer, user, add_generation_prompt=True, chat_template_kwargs=chat_template_kwargs)
        tail = gen[gen.rindex(_QUESTION) + len(_QUESTION):] if _QUESTION in gen else ""
        _MARKS_CACHE[key] = (tail, eot)
    return _MARKS_CACHE[key]


def _content_forms(content: str) -> list[str]:
    """The forms a template may write an assistant content in, most faithful first: verbatim, trimmed, or only
    its answer after ``</think>`` (templates that strip or re-render the reasoning)."""
    forms = [content, content.strip()]
    if "</think>" in content:
        answer = content.rsplit("</think>", 1)[1]
        forms += [answer.lstrip("\n"), answer.strip(), answer]
    return [f for f in dict.fromkeys(forms) if f]


def _prompt_end(full: str, tail: str, cursor: int) -> int | None:
    """Where the generation prompt of the next answer ends: after the longest newline-cut prefix of ``tail`` found at
    the first occurrence of its first line from ``cursor`` (a template may write less of it before earlier answers,
    e.g. Qwen3's empty think block only before the last); None when not found."""
    if not tail:
        return None
    first = tail[: tail.index("\n") + 1] if "\n" in tail else tail
    at = full.find(first, cursor)
    if at < 0:
        return None
    cuts = [tail] + [tail[: i + 1] for i in range(len(tail) - 2, len(first) - 2, -1) if tail[i] == "\n"]
    return at + len(next(c for c in cuts if full.startswith(c, at)))


def _locate(full: str, content: str, cursor: int, prompt_end: int | None) -> tuple[int, int] | None:
    """Character span of one answer in ``full``, searching from the end of its prompt (else from ``cursor``). What the
    template writes between the prompt's end and the answer is emitted by the model and included: whitespace
    (Mistral's space after ``[/INST]``) or a think block (Qwen3's, empty or holding the reasoning)."""
    for answer in _content_forms(content):
        at = full.find(answer, cursor if prompt_end is None else prompt_end)
        if at < 0:
            continue
        start = at
        if prompt_end is not None:
            gap = full[prompt_end:at]
            if not gap.strip() or (gap.startswith("<think>") and gap.rstrip().endswith("</think>")):
                start = prompt_end
        return start, at + len(answer)
    return None


def assistant_spans(tokenizer: Any, messages: Sequence[dict],
                    chat_template_kwargs: dict | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The full render of a conversation and the character span ``[start, end)`` of each assistant turn in it
    (from where its generation prompt ends to the end-of-turn marker after its content).

    Content search is anchored: before an answer, the cursor moves past the user turns before it and its
    generation prompt (so a short answer such as ``no`` is never found inside the question or a header)."""
    if any(m["role"] == "assistant" for m in messages[:1]):
        raise UserError("conversation starts with an assistant turn; normalise it first")
    template = str(getattr(tokenizer, "chat_template", "") or "")
    kwargs = dict(chat_template_kwargs or {})
    tail, eot = template_marks(tokenizer, kwargs)
    if _GENERATION_BLOCK.search(template):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, indices = render_jinja_template(conversations=[list(messages)], chat_template=template,
                                                  return_assistant_tokens_mask=True,
                                                  **{**tokenizer.special_tokens_map, **kwargs})
        full, spans = rendered[0], [tuple(s) for s in indices[0]]
    else:
        full = render(tokenizer, messages, chat_template_kwargs=kwargs)
        spans, cursor = [], 0
        for i, m in enumerate(messages):
            if m["role"] in ("user", "tool"):  # system turns are not searched: some templates move them
                at = full.find(m["content"].strip(), cursor)
                cursor = cursor if at < 0 else at + len(m["content"].strip())
                continue
            if m["role"] != "assistant":
                continue
            span = _locate(full, m["content"], cursor, _prompt_end(full, tail, cursor)) or _locate(full, m["content"], cursor, None)
            if span is None:
                raise UserError(f"assistant message {i} of this conversation does not appear in the chat template's "
                                f"render of it ({getattr(tokenizer, 'name_or_path', 'tokenizer')!r}); a template that "
                                "rewrites answers needs {% generation %} blocks for loss masks")
            spans.append(span)
            cursor = span[1]
    out = []
    for s, e in spans:
        body = full[s:e].rstrip(" \t\r\n")
        if eot and body.endswith(eot):  # a generation block that holds the marker (and whitespace after it)
            e = s + len(body)
        elif eot and full.startswith(eot, e):
            e += len(eot)
        elif eot:
            raise UserError(f"the chat template's end-of-turn marker {eot!r} does not follow an answer in this "
                            "conversation's render; check the template")
        out.append((s, e))
    return full, out


def render_segments(tokenizer: Any, messages: Sequence[dict],
                    chat_template_kwargs: dict | None = None) -> list[tuple[str, bool]]:
    """The render split into ``(text, is_assistant)`` segments whose concatenation is the full render."""
    full, spans = assistant_spans(tokenizer, messages, chat_template_kwargs)
    segments, cursor = [], 0
    for s, e in spans:
        if s > cursor:
            segments.append((full[cursor:s], False))
        segments.append((full[s:e], True))
        cursor = e
    if full[cursor:]:
        segments.append((full[cursor:], False))
    return segments


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict], max_length: int | None = None,
                          truncation: str = "turn", chat_template_kwargs: dict | None = None) -> dict[str, list[int]] | None:
    """Return ``{"input_ids", "loss_mask"}`` for a conversation, or None when it is dropped.

    Over-long conversations (``max_length``): ``turn`` keeps the longest prefix that ends with a whole
    assistant turn (a hard cut if even the first answer does not fit); ``hard`` cuts at max_length;
    ``drop`` drops the conversation. Needs a fast tokenizer (character offsets).
    """
    if truncation not in TRUNCATION_POLICIES:
        raise UserError(f"truncation={truncation!r}: use one of {', '.join(TRUNCATION_POLICIES)}")
    full, spans = assistant_spans(tokenizer, messages, chat_template_kwargs)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:
        raise UserError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} is not a fast tokenizer; loss masks need "
                        "character offsets (return_offsets_mapping)") from None
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    mask = [0] * len(ids)
    turn_ends: list[int] = []  # token index just after each assistant span
    k = 0
    for s, e in spans:
        last = None
        while k < len(ids) and offsets[k][0] < e:
            a, b = offsets[k]
            if b > s and b > a:  # overlaps the span (special tokens included; empty offsets never)
                mask[k], last = 1, k
            k += 1
        if last is not None:
            turn_ends.append(last + 1)
            k = last + 1
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
