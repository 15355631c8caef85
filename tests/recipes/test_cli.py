"""The argparse types of `recipes.cli` that the recipes, tools and benchmarks share."""

import argparse

import pytest

from recipes import cli


def test_int_list_sorts_and_deduplicates():
    assert cli.int_list("--sizes", 32)("128,32,64,32") == [32, 64, 128]


@pytest.mark.parametrize("text", ["", "a", "32,", "16,64", "32,256", "32x64"])
def test_int_list_refuses_bad_values_naming_the_flag(text):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        cli.int_list("--crops", 32, 128)(text)
    assert str(error.value) == (
        f"must be comma-separated integers of at least 32 and at most 128. Received: --crops {text!r}"
    )


def test_int_list_error_reaches_the_user_through_argparse(capsys):
    parser = argparse.ArgumentParser(prog="tool")
    parser.add_argument("--sizes", type=cli.int_list("--sizes", 2))
    with pytest.raises(SystemExit):
        parser.parse_args(["--sizes", "1,4"])
    assert "argument --sizes: must be comma-separated integers of at least 2. Received: --sizes '1,4'" in capsys.readouterr().err


def test_int_at_least_and_extents():
    assert cli.int_at_least("--count", 8)("8") == 8
    with pytest.raises(argparse.ArgumentTypeError, match="at least 8. Received: --count '7'"):
        cli.int_at_least("--count", 8)("7")
    assert cli.extents("--size", cube=True)("16") == (16, 16, 16)
    assert cli.extents("--size")("4x8x2") == (4, 8, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="Received: --size '4,8'"):
        cli.extents("--size")("4,8")
