"""Gossip news for the waiting thread (ftcomm.runtime.news): what the gossip thread posts
is judged on the waiting thread, and news dropped while nobody looked is not lost."""

from __future__ import annotations

import types

from ftcomm.runtime import news as news_module
from ftcomm.runtime.news import GossipNews
from tests.test_engine import engine, running


def event(kind: str, member: str, state: str = "alive", metadata=None):
    return types.SimpleNamespace(kind=kind, member=types.SimpleNamespace(id=member, state=state, metadata=metadata))


def test_news_dropped_while_nobody_looked_is_judged_from_every_members_present_record(monkeypatch):
    monkeypatch.setattr(news_module, "INBOX_LIMIT", 8)
    a = running(engine("a"))
    table = [("b", "alive", None), ("c", "alive", None)]
    news = GossipNews(a, lambda: list(table), lambda: 0, leave_grace=0.5, clock=lambda: 1.0)
    news.renew()
    for _ in range(8):  # harmless news fills the inbox: the gossip thread never waits
        news.post(event("metadata", "b"))
    news.post(event("dead", "c", "dead"))  # dropped: nobody looked for a long while
    assert news.changed.is_set()
    table[1] = ("c", "dead", None)
    news.judge()
    assert news.abort.reason == "c is dead"  # read from c's present record
    assert [(kind, member) for _, kind, member in news.faults] == [("dead", "c")]


def test_news_of_an_earlier_view_is_not_judged():
    a = running(engine("a"))
    clock = [1.0]
    news = GossipNews(a, lambda: [], lambda: 0, leave_grace=0.5, clock=lambda: clock[0])
    news.post(event("dead", "c", "dead"))
    clock[0] = 2.0
    news.renew()  # a new view from here: c's death was judged with the one before
    news.judge()
    assert news.abort.reason is None and news.faults == []
