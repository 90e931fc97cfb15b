"""--chat-template: a template of the operator's in place of the model's own, read and checked at
start, rendered inline and in the tokenizer's helper process, and served by the API servers the
scheduler starts."""

from __future__ import annotations

import grpc
import pytest

from pagewire_common.chat_template import load_chat_template
from pagewire_common.settings import Settings
from pagewire_common.v1 import generation_pb2 as pb
from scheduler_svc.api.tokenizer import OffloadedTokenizer, Tokenizer
from tests.service_utils import sampling, start_scheduler, start_worker, stub

# renders each message as "<role>: <content>" on its own line, and "assistant:" to answer
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]
RENDERED = "system: Be brief.\nuser: Tell me about the sea.\nassistant:"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-gqa")


@pytest.fixture
def template_file(tmp_path):
    path = tmp_path / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


def test_a_file_or_the_template_itself(template_file):
    assert load_chat_template(str(template_file)) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE


@pytest.mark.parametrize("value, message", [
    ("/no/such/chat.jinja", "no chat template file /no/such/chat.jinja"),
    ("{% for m in messages %}{{ m.content }", "chat template does not parse: unexpected '}' (line 1)"),
    ("{% if x %}\n\n{% endfor %}", "(line 3)"),
    ("\n", "is empty"),
])
def test_a_bad_template_fails_at_start_naming_the_flag(value, message):
    with pytest.raises(ValueError, match="--chat-template") as err:
        Settings(chat_template=value)
    assert message in str(err.value)


def test_a_folder_or_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not a file"):
        load_chat_template(str(tmp_path))
    latin1 = tmp_path / "latin1.jinja"
    latin1.write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(ValueError, match="cannot read the chat template"):
        load_chat_template(str(latin1))


def test_it_replaces_the_models_own_inline_and_in_the_helper(model_dir):
    files = Tokenizer(model_dir).files
    own = Tokenizer.from_files(files)
    assert own.chat_template and own.apply_chat_template(MESSAGES) != RENDERED
    tokenizer = Tokenizer.from_files(files, TEMPLATE)
    assert tokenizer.apply_chat_template(MESSAGES) == RENDERED
    offloaded = OffloadedTokenizer(tokenizer, inline_chars=4)  # every chat goes to the helper process
    try:
        import asyncio

        prompt, ids = asyncio.run(offloaded.encode_chat(MESSAGES))
        assert prompt == RENDERED and ids == tokenizer.encode(RENDERED)
        assert offloaded._pool is not None
    finally:
        offloaded.close()


@pytest.mark.parametrize("final", ["Once upon a", "  leading spaces", "trailing spaces  ", "\n both \n", "a\nb",
                                   "<", "|", "im_end", "", " "])
def test_continue_final_message_renders_as_transformers_does(model_dir, final):
    """The conversation ends inside its final message, cut where transformers' own
    ``continue_final_message`` cuts it, whitespace included."""
    from transformers import AutoTokenizer

    messages = [*MESSAGES, {"role": "assistant", "content": final}]
    ours = Tokenizer(model_dir).apply_chat_template(messages, add_generation_prompt=False,
                                                    continue_final_message=True)
    theirs = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(messages, tokenize=False,
                                                                         continue_final_message=True)
    assert ours == theirs and ours.rstrip().endswith(final.strip())


def test_continue_final_message_refusals(model_dir):
    tokenizer = Tokenizer(model_dir)
    messages = [*MESSAGES, {"role": "assistant", "content": "Waves"}]
    with pytest.raises(ValueError, match="cannot both be true"):
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    shouting = "{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(ValueError, match="changes the final message"):
        tokenizer.apply_chat_template(messages, False, shouting, True)


@pytest.mark.slow
def test_the_api_servers_render_chats_with_it(model_dir, template_file, tmp_path):
    """The scheduler hands --chat-template to the API servers it starts: Tokenize shows the prompt,
    and a Chat runs on it (the tokens of the same prompt sent as Generate)."""
    worker, worker_addr = start_worker(model_dir, tmp_path, extra=["--block-size", "4", "--num-kv-blocks", "200"])
    sched, addr = start_scheduler(worker_addr, tmp_path, extra=["--chat-template", str(template_file)])
    try:
        client = stub(addr)
        chat = [pb.ChatMessage(role=m["role"], content=m["content"]) for m in MESSAGES]
        assert client.Tokenize(pb.TokenizeRequest(messages=chat)).prompt == RENDERED
        params = sampling(max_tokens=6, ignore_eos=True)
        chat_ids = [t for r in client.Chat(pb.ChatRequest(messages=chat, sampling=params)) for t in r.token_ids]
        generated = [t for r in client.Generate(pb.GenerateRequest(prompt=RENDERED, sampling=params))
                     for t in r.token_ids]
        assert len(chat_ids) == 6 and chat_ids == generated
        # how the conversation ends: after its last message, or inside it
        plain = client.Tokenize(pb.TokenizeRequest(messages=chat, add_generation_prompt=False)).prompt
        assert plain == RENDERED.removesuffix("assistant:")
        begun = [*chat, pb.ChatMessage(role="assistant", content="The sea is")]
        request = pb.ChatRequest(messages=begun, sampling=params, add_generation_prompt=False,
                                 continue_final_message=True)
        continued = [t for r in client.Chat(request) for t in r.token_ids]
        prompt = RENDERED.removesuffix("assistant:") + "assistant: The sea is"
        assert client.Tokenize(pb.TokenizeRequest(messages=begun, add_generation_prompt=False,
                                                  continue_final_message=True)).prompt == prompt
        assert continued == [t for r in client.Generate(pb.GenerateRequest(prompt=prompt, sampling=params))
                             for t in r.token_ids]
        for call in (lambda: list(client.Chat(pb.ChatRequest(messages=begun, sampling=params,
                                                            continue_final_message=True))),
                     lambda: client.Tokenize(pb.TokenizeRequest(messages=begun, continue_final_message=True))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot both be true" in err.value.details()
    finally:
        sched.stop()
        worker.stop()


def test_the_offline_llm_chats_as_the_servers_do(model_dir, template_file):
    """LLM.chat renders each conversation (the model's template, or one given as a file or text)
    and generates from it as generate does; a conversation it cannot render is a ValueError."""
    import gc

    from pagewire import LLM, SamplingParams

    llm = LLM(model_dir, block_size=4, num_kv_blocks=200)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
        own = llm.tokenizer.apply_chat_template(MESSAGES)
        one = llm.chat(MESSAGES, params)
        assert len(one) == 1 and one[0].token_ids == llm.generate(own, params)[0].token_ids
        assert one[0].prompt_token_ids == llm.tokenizer.encode(own)
        two = llm.chat([MESSAGES, MESSAGES[1:]], params, chat_template=str(template_file))
        assert [o.prompt_token_ids for o in two] == [llm.tokenizer.encode(RENDERED),
                                                     llm.tokenizer.encode("user: Tell me about the sea.\nassistant:")]
        assert llm.chat(MESSAGES, params, chat_template=TEMPLATE)[0].token_ids == two[0].token_ids
        unprompted = llm.chat(MESSAGES, params, chat_template=TEMPLATE, add_generation_prompt=False)[0]
        assert unprompted.prompt_token_ids == llm.tokenizer.encode(RENDERED.removesuffix("assistant:"))
        begun = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
        continued = llm.chat(begun, params, chat_template=TEMPLATE, add_generation_prompt=False,
                             continue_final_message=True)[0]
        assert continued.prompt_token_ids == llm.tokenizer.encode(RENDERED + " The sea is")
        with pytest.raises(ValueError, match="cannot both be true"):
            llm.chat(begun, params, continue_final_message=True)
        for bad, message in (([], "messages is empty"), ([MESSAGES, []], "conversation 1: it must be a non-empty"),
                             ([[{"role": "user"}]], "conversation 0: every chat message needs string content")):
            with pytest.raises(ValueError, match=message):
                llm.chat(bad, params)
        with pytest.raises(ValueError, match="no chat template file"):
            llm.chat(MESSAGES, params, chat_template="/no/such.jinja")
    finally:
        llm.close()
        gc.unfreeze()
