from __future__ import annotations

import pytest

from tests.entrypoints.openai.helpers import ThreadedServer, make_app, make_engine, write_char_tokenizer

API_KEY = "test-key"


@pytest.fixture(scope="session")
def char_tokenizer_dir(tmp_path_factory):
    return write_char_tokenizer(tmp_path_factory.mktemp("char-tokenizer"))


@pytest.fixture(scope="module")
def mock_server(char_tokenizer_dir):
    """A real uvicorn (in a thread) serving a mock engine: 2 ms per step, poison token '~' (id 95)."""
    engine = make_engine(char_tokenizer_dir, delay_s=0.002, poison_token=95)
    app, async_engine = make_app(engine, api_key=API_KEY, max_request_bytes=64 * 1024)
    with ThreadedServer(app) as server:
        server.engine = engine
        server.async_engine = async_engine
        yield server


@pytest.fixture()
def client(mock_server):
    import openai

    return openai.OpenAI(base_url=f"{mock_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
