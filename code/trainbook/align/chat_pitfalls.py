"""Chat-template pitfalls, measured: the same conversation reaching the model as different ids.

A chat model is trained on one rendering of its template and is only evaluated fairly on that
rendering. The commonest slip is the double BOS. Many templates write the BOS token themselves
(Llama 3's starts with `<|begin_of_text|>`), and many tokenizers also add one when called with
their default `add_special_tokens=True` (the `TemplateProcessing` post-processor of Llama's
`tokenizer.json`). `apply_chat_template(..., tokenize=True)` knows this and tokenizes without
special tokens; rendering the template to text first and then calling the tokenizer on the text
(what an evaluation harness or a serving stack does when it takes prompts as strings) adds the
second BOS. The model then sees a prefix it never saw in training.

`bos_adding` makes the book's chat tokenizer behave like Llama's (a post-processor that
prepends `<|bos|>`); `renderings` gives the three ways of tokenizing a rendered prompt through
transformers; `bos_effect` measures, on the same model and items, what each rendering does to
the log-likelihood of the right answer and to greedy accuracy.

Chapter: book/alignment/evaluation
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from . import evaluation as E
from . import task

RIGHT = "apply_chat_template(tokenize=True)"
DOUBLE = "render to text, then tokenizer(text)"
RIGHT_TEXT = "render to text, then tokenizer(text, add_special_tokens=False)"
NO_PROMPT = "apply_chat_template without add_generation_prompt"
NO_TEMPLATE = "no template: tokenizer(prompt)"


def bos_adding(tok: task.ChatTokenizer) -> Any:
    """A copy of the chat tokenizer's `tokenizers.Tokenizer` that prepends `<|bos|>` to every
    encoding with special tokens on, as Llama's tokenizer.json does."""
    from tokenizers import Tokenizer, processors

    if not isinstance(tok, task.ChatTokenizer):
        raise ValueError(f"tok must be the ChatTokenizer, got {type(tok).__name__}")
    bos = task.SPECIAL[task.BOS]
    out = Tokenizer.from_str(tok.hf.to_str())
    out.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, task.BOS)])
    return out


def save_bos_adding(tok: task.ChatTokenizer, folder: str | Path) -> Path:
    """The chat tokenizer's files with the BOS-adding post-processor (and add_bos_token in
    its config): what transformers' AutoTokenizer then loads."""
    folder = Path(folder)
    tok.save_pretrained(folder)
    bos_adding(tok).save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["add_bos_token"] = True
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return folder


def renderings(hf_tok: Any, prompt: str) -> dict[str, list[int]]:
    """The ids a user turn reaches the model as, five ways, through a transformers tokenizer
    with a chat template: right (tokenized by the template call, or rendered and tokenized
    without special tokens), with a second BOS, without the assistant header that asks for the
    answer, and with no template at all."""
    if not getattr(hf_tok, "chat_template", None):
        raise ValueError("hf_tok must be a transformers tokenizer with a chat template")
    messages = [{"role": "user", "content": prompt}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def templated(generation_prompt: bool) -> list[int]:
        ids = hf_tok.apply_chat_template(messages, tokenize=True,
                                         add_generation_prompt=generation_prompt)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    return {RIGHT: templated(True), DOUBLE: hf_tok(text)["input_ids"],
            RIGHT_TEXT: hf_tok(text, add_special_tokens=False)["input_ids"],
            NO_PROMPT: templated(False), NO_TEMPLATE: hf_tok(prompt)["input_ids"]}


def leading_bos(ids: Sequence[int]) -> int:
    """How many BOS tokens a sequence starts with."""
    n = 0
    while n < len(ids) and ids[n] == task.BOS:
        n += 1
    return n


def bos_effect(model: nn.Module, tok: task.ChatTokenizer, hf_tok: Any,
               items: Sequence[task.Problem]) -> list[dict]:
    """Per rendering: leading BOS tokens, the mean log-likelihood of the right answer and its
    `<|eos|>`, and greedy accuracy (a completion must end with `<|eos|>`)."""
    if not items:
        raise ValueError("no items to score")
    by_variant: dict[str, list[list[int]]] = {}
    for p in items:
        for name, ids in renderings(hf_tok, p.prompt).items():
            by_variant.setdefault(name, []).append(ids)
    answers = [tok.encode(p.answer) + [task.EOS] for p in items]
    rows = []
    for name, prompts in by_variant.items():
        lls, _ = E.continuation_logprobs(model, prompts, answers)
        right = E.sample_counts(model, tok, items, 1, form="chat", greedy=True, prompts=prompts)
        rows.append({"rendering": name, "leading BOS": leading_bos(prompts[0]),
                     "same ids as training": prompts == task.encode_prompts(tok, items),
                     "mean log p(answer)": statistics.fmean(lls),
                     "greedy accuracy": sum(right) / len(items)})
    return rows
