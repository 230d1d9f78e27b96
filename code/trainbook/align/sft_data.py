"""SFT data: chat templates, where the loss mask goes, and which tokens a loss trains.

A chat model is trained on conversations rendered to one token sequence by a chat template (a
Jinja program shipped in the tokenizer's config) and on a loss mask saying which of those tokens
the loss trains. The book's format (`task.CHAT_TEMPLATE`: `<|bos|><|user|>07+58<|assistant|>65
<|eos|>`) is the usual layout cut to its parts; real templates add headers, roles, newlines and
default system prompts around the same skeleton. `TEMPLATES` names two real ones, read from the
copies the installed trl keeps of them (`trl/chat_templates/*.jinja`, kept identical to the
models' own and checked against the Hub weekly by trl): Meta's Llama 3 Instruct template and
Qwen2.5's ChatML. `hf_tokenizer` puts a template on a transformers tokenizer over the book's
byte vocabulary (its special tokens added), so the same conversation renders through
`apply_chat_template` under each, and `layout` shows the result:

- the text and the token count of one exchange, against the tokens of its content;
- the generation prompt (what `add_generation_prompt=True` appends: the model continues there);
- the completion mask as trl computes it for a prompt-completion dataset (the tokens after the
  rendered prompt with its generation prompt: `completion_mask`), and the assistant mask that
  trl's training variant of the template marks with `{% generation %}` (`assistant_only_loss`);
  the two differ on the newlines around Qwen2.5's `<|im_end|>`.

`double_bos` measures a pitfall: a template that writes the BOS token itself (Llama 3's does),
rendered to text and then tokenized by a tokenizer that adds BOS too, starts with two. And
`loss_mask` turns the assistant-token examples of `sft.examples` into all-token ones, for the
chapter's comparison of the two losses.

Chapter: book/alignment/sft
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from .task import CHAT_TEMPLATE, SPECIAL, ChatTokenizer

# The book's template with trl's `{% generation %}` markers around what the assistant produces
# (its answer and <|eos|>), so that `return_assistant_tokens_mask` / trl's `assistant_only_loss`
# mark the same tokens as `ChatTokenizer.chat_ids`' mask.
TRAINING_TEMPLATE = ("{{ '<|bos|>' }}{% for m in messages %}{% if m['role'] == 'user' %}"
                     "{{ '<|user|>' + m['content'] }}{% else %}{{ '<|assistant|>' }}"
                     "{% generation %}{{ m['content'] + '<|eos|>' }}{% endgeneration %}{% endif %}"
                     "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
LOSS_ON = ("assistant", "all")


@dataclass(frozen=True)
class Template:
    """A chat template and the token facts that go with it."""

    name: str
    source: str  # where the Jinja program comes from
    trl_file: str | None  # trl/chat_templates/<trl_file>.jinja (and <trl_file>_training.jinja)
    special: tuple[str, ...]  # the special tokens it writes
    bos: str | None  # the BOS token the template writes itself, if any
    end_of_turn: str  # the token that ends an assistant turn: generation stops on it

    def jinja(self, training: bool = False) -> str:
        """The Jinja program; `training=True`: the variant with `{% generation %}` markers."""
        if self.trl_file is None:
            return TRAINING_TEMPLATE if training else CHAT_TEMPLATE
        name = f"{self.trl_file}_training.jinja" if training else f"{self.trl_file}.jinja"
        return (resources.files("trl") / "chat_templates" / name).read_text()


TEMPLATES = {t.name: t for t in (
    Template("trainbook", "trainbook.align.task.CHAT_TEMPLATE", None, SPECIAL, "<|bos|>",
             "<|eos|>"),
    Template("llama-3", "Meta-Llama-3-Instruct's tokenizer_config.json, as trl keeps it in "
             "trl/chat_templates/llama3.jinja", "llama3",
             ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
             "<|begin_of_text|>", "<|eot_id|>"),
    Template("qwen2.5", "Qwen2.5-Instruct's tokenizer_config.json (ChatML), as trl keeps it in "
             "trl/chat_templates/qwen2_5.jinja", "qwen2_5", ("<|im_start|>", "<|im_end|>"),
             None, "<|im_end|>"),
)}


def template(name: str) -> Template:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; use one of {', '.join(TEMPLATES)}")
    return TEMPLATES[name]


def hf_tokenizer(tok: ChatTokenizer, name: str = "trainbook", add_bos: bool = False) -> Any:
    """A transformers tokenizer over the book's byte vocabulary with the template's special
    tokens added (after the 261 ids) and its chat template set. `add_bos=True` makes encoding
    text prepend the template's BOS token, as Llama 3's tokenizer does."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    spec = template(name)
    if add_bos and spec.bos is None:
        raise ValueError(f"template {name!r} has no BOS token to add; add_bos needs llama-3 or "
                         "trainbook")
    backend = Tokenizer.from_str(tok.hf.to_str())
    backend.add_special_tokens([s for s in spec.special if backend.token_to_id(s) is None])
    if add_bos:
        bos_id = backend.token_to_id(spec.bos)
        backend.post_processor = TemplateProcessing(single=f"{spec.bos} $A",
                                                    pair=f"{spec.bos} $A $B",
                                                    special_tokens=[(spec.bos, bos_id)])
    hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=spec.bos,
                                 eos_token=spec.end_of_turn, pad_token=SPECIAL[0])
    hf.chat_template = spec.jinja()
    return hf


def conversation(prompt: str, response: str | None = None) -> list[dict[str, str]]:
    """The chat messages of one exchange (the user's prompt, and the answer if given)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    out = [{"role": "user", "content": prompt}]
    if response is not None:
        if not isinstance(response, str):
            raise ValueError(f"response must be a string, got {type(response).__name__}")
        out.append({"role": "assistant", "content": response})
    return out


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id lists."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def completion_mask(prompt_ids: Sequence[int], full_ids: Sequence[int]) -> list[int]:
    """1 on the tokens of full_ids after the prompt (the rendered prompt with its generation
    prompt), 0 on the prompt: trl's completion mask for a prompt-completion example."""
    n = common_prefix(prompt_ids, full_ids)
    return [0] * n + [1] * (len(full_ids) - n)


@dataclass
class Layout:
    """One exchange under one template: what the model sees and what the loss trains."""

    template: str
    text: str  # the rendered exchange
    generation_prompt: str  # what add_generation_prompt=True appends to the rendered prompt
    ids: list[int]
    content_tokens: int  # tokens of the prompt's and the answer's text alone
    completion_mask: list[int]  # trl's prompt-completion mask
    assistant_mask: list[int]  # the training template's {% generation %} mask
    completion_text: str  # the tokens completion_mask trains, decoded
    assistant_text: str  # the tokens assistant_mask trains, decoded

    @property
    def overhead(self) -> int:
        """Tokens the template adds around the content."""
        return len(self.ids) - self.content_tokens


def layout(tok: ChatTokenizer, name: str, prompt: str, response: str) -> Layout:
    """Render the exchange under template `name` through transformers' apply_chat_template and
    compute both loss masks (see the module docstring)."""
    hf = hf_tokenizer(tok, name)
    messages = conversation(prompt, response)
    text = hf.apply_chat_template(messages, tokenize=False)
    bare = hf.apply_chat_template(messages[:1], tokenize=False)
    with_prompt = hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(messages, tokenize=True)["input_ids"]
    prompt_ids = hf.apply_chat_template(messages[:1], tokenize=True,
                                        add_generation_prompt=True)["input_ids"]
    marked = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                    return_assistant_tokens_mask=True,
                                    chat_template=template(name).jinja(training=True))
    if marked["input_ids"] != ids:
        raise RuntimeError(f"{name}: the training template renders other tokens than the "
                           "template itself")
    done, marks = completion_mask(prompt_ids, ids), list(marked["assistant_masks"])

    def trained(mask: list[int]) -> str:
        return hf.decode([i for i, k in zip(ids, mask) if k], skip_special_tokens=False)
    return Layout(name, text, with_prompt[len(bare):], ids,
                  len(tok.encode(prompt)) + len(tok.encode(response)), done, marks,
                  trained(done), trained(marks))


def double_bos(tok: ChatTokenizer, name: str = "llama-3", prompt: str = "07+58") -> dict[str, int]:
    """BOS tokens at the start of a rendered prompt, tokenized two ways by a tokenizer that adds
    BOS (as Llama 3's does): by apply_chat_template (which encodes without adding special
    tokens), and by rendering to text and then calling the tokenizer on it (which adds one more
    to the template's own)."""
    hf = hf_tokenizer(tok, name, add_bos=True)
    messages = conversation(prompt)
    right = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    wrong = hf(text)["input_ids"]
    bos = hf.convert_tokens_to_ids(template(name).bos)

    def leading(ids: list[int]) -> int:
        return common_prefix(ids, [bos] * len(ids))
    return {"apply_chat_template": leading(right["input_ids"]), "render, then tokenize":
            leading(wrong), "render, then tokenize without special tokens":
            leading(hf(text, add_special_tokens=False)["input_ids"])}


def loss_mask(data: Sequence[tuple[list[int], list[int]]], on: str = "assistant"
              ) -> list[tuple[list[int], list[int]]]:
    """(ids, mask) examples with the loss on the assistant's tokens (as given) or on all tokens
    (every token after the first is a target)."""
    if on not in LOSS_ON:
        raise ValueError(f"on must be one of {LOSS_ON}, got {on!r}")
    if not data:
        raise ValueError("no examples")
    if on == "assistant":
        return [(list(ids), list(mask)) for ids, mask in data]
    return [(list(ids), [1] * len(ids)) for ids, _ in data]
