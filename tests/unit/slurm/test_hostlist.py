from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from slurmft.slurm.hostlist import HostlistError, compress, expand


@pytest.mark.parametrize(
    ("expression", "names"),
    [
        ("", []),
        ("n1", ["n1"]),
        ("n[1-3,7]", ["n1", "n2", "n3", "n7"]),
        ("n[1-2],n[5-6]", ["n1", "n2", "n5", "n6"]),
        ("n[01-03]", ["n01", "n02", "n03"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("gpu[1-2],cpu3,login", ["gpu1", "gpu2", "cpu3", "login"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
        ("rack1-n[3,5]", ["rack1-n3", "rack1-n5"]),
    ],
)
def test_expand(expression: str, names: list[str]) -> None:
    assert expand(expression) == names


@pytest.mark.parametrize("bad", ["n[1-", "n]1", "n[[1]]", "n[3-1]", "n[a-b]", "n[1-x]"])
def test_expand_rejects_what_slurm_rejects(bad: str) -> None:
    with pytest.raises(HostlistError):
        expand(bad)


@pytest.mark.parametrize(
    ("names", "expression"),
    [
        (["n1", "n2", "n3", "n7"], "n[1-3,7]"),
        (["n7", "n3", "n1", "n2", "n2"], "n[1-3,7]"),  # unordered, duplicated
        (["n1"], "n1"),
        (["n01", "n02", "n03"], "n[01-03]"),
        (["n9", "n10"], "n[9-10]"),
        (["n09", "n10"], "n[09-10]"),
        (["n1", "n01"], "n[01,1]"),  # different names with the same number
        (["login", "n1", "n2"], "login,n[1-2]"),
        (["gpu1", "gpu2", "cpu1"], "cpu1,gpu[1-2]"),
        (["n1-ib", "n2-ib"], "n[1-2]-ib"),
        ([], ""),
    ],
)
def test_compress(names: list[str], expression: str) -> None:
    assert compress(names) == expression


@pytest.mark.parametrize("bad", ["", "n[1]", "a,b", " n1"])
def test_compress_rejects_non_names(bad: str) -> None:
    with pytest.raises(HostlistError):
        compress([bad])


host_names = st.builds(
    lambda prefix, number, width, suffix: f"{prefix}{str(number).zfill(width)}{suffix}",
    st.sampled_from(["n", "gpu-", "rack1-n", "x"]),
    st.integers(min_value=0, max_value=300),
    st.integers(min_value=0, max_value=4),
    st.sampled_from(["", "-ib"]),
) | st.sampled_from(["login", "head"])


@given(st.lists(host_names, max_size=40))
def test_compress_then_expand_gives_the_same_hosts(names: list[str]) -> None:
    expanded = expand(compress(names))
    assert sorted(expanded) == sorted(set(names))
    assert len(expanded) == len(set(names))


@given(st.lists(host_names, min_size=1, max_size=40))
def test_compress_is_canonical(names: list[str]) -> None:
    assert compress(expand(compress(names))) == compress(names)
