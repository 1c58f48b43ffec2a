"""Chat templates: a conversation rendered with a tokenizer's own jinja2 ``chat_template``, as transformers
renders it, and the exact token positions of its assistant turns.

Rendering follows transformers' ``apply_chat_template`` (``transformers/utils/chat_template_utils.py``):
a sandboxed, immutable jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that does not escape HTML (``json.dumps``,
``ensure_ascii=False``), the globals ``raise_exception(message)`` (a template error) and
``strftime_now(format)``, the variables ``messages`` and ``add_generation_prompt`` plus the tokenizer's
named special tokens (``bos_token``, ``eos_token``, ... as strings), and messages whose ``None`` values
are dropped. The rendered text is then tokenized as a whole with the tokenizer's added tokens
recognised (``encode(text, add_special_tokens=False)`` in transformers), so the ids equal
``tokenizer.apply_chat_template(messages, tokenize=True)``. As there, special-token text inside a
message (a literal ``<|im_end|>``) becomes that special token. Not supported: tools, documents,
``continue_final_message``.

Assistant spans, by prefix rendering (any template, no markers needed): for the assistant message at
index i, the turn starts where ``render(messages[:i], add_generation_prompt=True)`` ends (after the
template's assistant header) and ends where ``render(messages[:i + 1])`` ends (after its end-of-turn
text, e.g. ``<|im_end|>\\n``). Both must be prefixes of the whole rendering, else the template rewrites
earlier turns (as templates that strip past reasoning do) and we raise rather than guess. A token
belongs to the turn when its first character lies in that span. ``{% generation %}`` blocks (transformers'
marker for its assistant mask) are accepted and rendered unchanged; their positions are not used, so
both kinds of template get the same definition. Cost: two extra renders per assistant turn.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from torchtitan.datasets.tokenizer import HFTokenizer
from torchtitan.datasets.tokenizer.hf_tokenizer import CONFIG_FILE, find_hf_tokenizer_file

# transformers' SPECIAL_TOKENS_ATTRIBUTES: the names its templates receive as variables
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
TEMPLATE_FILE = "chat_template.jinja"  # where transformers 5 saves a tokenizer's template

# The built-in template for tokenizers without one: ChatML, as Qwen's templates write a plain turn.
# Each message is "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt is
# "<|im_start|>assistant\n". The tokenizer must have <|im_start|> and <|im_end|> as added tokens.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
DEFAULT_TEMPLATE_TOKENS = ("<|im_start|>", "<|im_end|>")


class _GenerationBlock(Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes HTML characters (<, >, &), which would change the rendered prompt
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandboxed environment transformers uses (cached by its text).

    Raises:
        jinja2.TemplateSyntaxError: the template does not parse.
    """
    # Templates come from model repos: untrusted code, hence the sandbox (no attribute escapes, immutable)
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(
    template: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool, variables: Mapping[str, str]
) -> str:
    """The text ``template`` renders for ``messages``.

    Raises:
        jinja2.TemplateError: the template fails, or calls ``raise_exception``.
    """
    # as transformers: a None value means the key is absent (templates test `'key' in message`)
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    return compile_chat_template(template).render(
        **variables, messages=plain, add_generation_prompt=add_generation_prompt
    )


def assistant_char_spans(
    template: str, messages: Sequence[Mapping[str, Any]], *, variables: Mapping[str, str]
) -> tuple[str, list[tuple[int, int]]]:
    """The whole rendering of ``messages`` and the [start, end) character span of each assistant turn.

    Raises:
        ValueError: a prefix rendering is not a prefix of the whole (the template rewrites earlier turns).
        jinja2.TemplateError: the template fails on the conversation or one of its prefixes.
    """
    text = render_chat(template, messages, add_generation_prompt=False, variables=variables)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = render_chat(template, messages[:i], add_generation_prompt=True, variables=variables)
        turn = render_chat(template, messages[: i + 1], add_generation_prompt=False, variables=variables)
        if not (turn.startswith(prompt) and text.startswith(turn)):
            raise ValueError(
                f"the chat template renders message {i} (assistant) differently once later messages follow, so its "
                "tokens cannot be located; use a template that keeps earlier turns unchanged, or loss_on='all'"
            )
        spans.append((len(prompt), len(turn)))
    return text, spans


def _token_string(value: object) -> str | None:
    """A special token named in tokenizer_config.json: a string or a {"content": ...} dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_template(config: dict, folder: Path) -> str | None:
    """The tokenizer's template: ``chat_template`` in its config (a string, or named templates whose
    "default" is used), else ``chat_template.jinja`` beside it; None when it has none."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None and (folder / TEMPLATE_FILE).is_file():
        template = (folder / TEMPLATE_FILE).read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder / CONFIG_FILE}: chat_template must be a string, got {type(template).__name__}")
    return template


class ChatTokenizer:
    """A Hugging Face tokenizer folder read for chat data: ``HFTokenizer`` plus its chat template.

    Args:
        path: a ``tokenizer.json`` or the folder holding it, with ``tokenizer_config.json`` beside it
            (special tokens, and ``chat_template`` if the model has one).
        base: the ``HFTokenizer`` of ``path`` if the caller has built it already.

    ``base`` encodes plain text (special-token text stays text); chat renderings are encoded as prompts
    (``base.prompt_model``) with no special tokens added: the template writes its control tokens (a bos where it
    wants one) as text, and they are recognised.
    """

    def __init__(self, path: str, *, base: HFTokenizer | None = None) -> None:
        # HFTokenizer checks the files, the special tokens and the ids (``base``: one already built from path)
        self.base = base if base is not None else HFTokenizer(path)
        file = find_hf_tokenizer_file(path)
        assert file is not None  # HFTokenizer found it
        config_path = file.with_name(CONFIG_FILE)
        config = json.loads(config_path.read_text(encoding="utf-8"))  # HFTokenizer read it already
        self.variables = {
            name: token for name in SPECIAL_TOKEN_NAMES if (token := _token_string(config.get(name))) is not None
        }
        self.chat_template = _read_template(config, file.parent)
        # a rendering is a prompt: its control tokens, written as text, are the tokens (the template decides them)
        self._chat_model = self.base.prompt_model
        self._source = str(file)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def template_source(self) -> str:
        """The tokenizer's own template, else ``DEFAULT_CHAT_TEMPLATE`` when its tokens exist.

        Raises:
            ValueError: no own template and <|im_start|> / <|im_end|> are not added tokens.
        """
        if self.chat_template is not None:
            return self.chat_template
        added = {t.content for t in self._chat_model.get_added_tokens_decoder().values()}
        missing = [t for t in DEFAULT_TEMPLATE_TOKENS if t not in added]
        if missing:
            raise ValueError(
                f"{self._source} has no chat_template and lacks the built-in ChatML template's tokens {missing}; "
                "add a chat_template to its tokenizer_config.json, or use prompt/completion data"
            )
        return DEFAULT_CHAT_TEMPLATE

    def token_id(self, token: str) -> int | None:
        """The id of ``token`` (an added token's too), or None when the vocabulary lacks it."""
        return self._chat_model.token_to_id(token)

    def encode_chat(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """A rendered chat -> its token ids and each token's [start, end) character offsets."""
        encoding = self._chat_model.encode(text, add_special_tokens=False)
        return list(encoding.ids), list(encoding.offsets)

    def tokenize_chat(self, messages: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[bool]]:
        """``messages`` -> token ids and, per token, whether it belongs to an assistant turn.

        Raises:
            ValueError: see ``assistant_char_spans`` and ``template_source``.
            jinja2.TemplateError: the template fails on the conversation.
        """
        text, spans = assistant_char_spans(self.template_source(), messages, variables=self.variables)
        ids, offsets = self.encode_chat(text)
        in_turn = [any(start <= first < end for start, end in spans) for first, _ in offsets]
        return ids, in_turn
