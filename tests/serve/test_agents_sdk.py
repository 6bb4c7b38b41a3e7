"""The openai-agents SDK (OpenAI's agent framework, which speaks the Responses API) runs a
one-tool agent against `jaxkv serve`: the first turn must call the tool (tool_choice
"required"), the SDK runs it and sends the result back as a function_call_output item, and the
second turn (tool_choice back to auto, served by --enable-auto-tool-choice with the hermes
parser) answers in text. Its own server: the shared one keeps auto tool choice off."""

from __future__ import annotations

import asyncio

import pytest

from tests.serve.conftest import API_KEY, MODEL, launched

agents = pytest.importorskip("agents")


@pytest.fixture(scope="module")
def auto_server():
    yield from launched(("--enable-auto-tool-choice", "--tool-call-parser", "hermes"))


def test_one_tool_agent(auto_server):
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather of a city."""
        cities.append(city)
        return f"The weather in {city} is sunny, 21 C."

    client = AsyncOpenAI(base_url=auto_server.url + "/v1", api_key=API_KEY, max_retries=0)
    agent = agents.Agent(
        name="weather", instructions="Use the tool to answer.", tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=64))
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert cities and cities[0].strip()  # the tool ran with the argument the model wrote
    kinds = [type(item).__name__ for item in result.new_items]
    assert "ToolCallItem" in kinds and "ToolCallOutputItem" in kinds and kinds[-1] == "MessageOutputItem"
    assert isinstance(result.final_output, str) and result.final_output.strip()
