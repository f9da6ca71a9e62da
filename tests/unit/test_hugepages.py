"""The huge-page tunable a worker starts with: added to what GLIBC_TUNABLES holds, never over
a choice already made."""

from __future__ import annotations

from tailserve.assembly.hugepages import HUGE_PAGES, with_huge_pages


def test_the_tunable_is_set_where_none_is() -> None:
    env = with_huge_pages({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": HUGE_PAGES}


def test_other_tunables_are_kept() -> None:
    env = with_huge_pages({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=2:{HUGE_PAGES}"


def test_a_huge_page_choice_already_made_is_left_alone() -> None:
    env = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert with_huge_pages(env) == env
