"""The local bench's llama.cpp section: what it writes with and without llama-cpp-python."""

from __future__ import annotations

from proxy.bench import llamacpp, local


def test_without_llama_cpp_the_section_says_how_to_build_it() -> None:
    lines = llamacpp.markdown_lines({"llamacpp": None})
    assert "make test-llamacpp" in lines[0] and "not measured" in lines[0]


def test_llama_cpp_sits_beside_sluice_against_generate() -> None:
    results = {
        "stream_tokens": 128,
        "single_repeat": 3,
        "llamacpp": {
            "llamacpp": {"one_tokens_per_s": 80.0, "many_tokens_per_s": 85.0},
            "batched": {"one_tokens_per_s": 60.0, "many_tokens_per_s": 170.0},
            "generate_tokens_per_s": 20.0,
        },
    }
    text = "\n".join(llamacpp.markdown_lines(results))
    assert "| llama.cpp | 80.0 (4.00x generate) | 85.0 (4.25x generate) |" in text
    assert "| Sluice | 60.0 (3.00x generate) | 170.0 (8.50x generate) |" in text
    assert f"{llamacpp.STREAMS} streams at once" in text


def test_the_llama_cpp_section_is_one_of_the_benchs() -> None:
    assert "llamacpp" in local.SECTIONS
