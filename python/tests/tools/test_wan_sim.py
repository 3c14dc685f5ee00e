"""scripts/wan-sim's plan of namespaces and links, and its link cuts, without creating anything."""
import json

import pytest

from decoupled_diloco.tools import wan_sim


def test_parse_cut():
    assert wan_sim.parse_cut("us@30+60", ["eu", "us"]) == ("us", 30.0, 60.0)
    for bad in ("asia@30+60", "us@30", "us+60@30"):
        with pytest.raises(SystemExit):
            wan_sim.parse_cut(bad, ["eu", "us"])


def test_every_region_gets_its_own_link_with_a_token_bucket_each_way():
    net = wan_sim.Net("tt", ["eu", "us"], {"eu": "20mbit", "us": "1mbit"}, "32kb", "256kb")
    commands = net.commands()
    assert commands[:3] == [["ip", "netns", "add", "tt-core"], ["ip", "-n", "tt-core", "link", "set", "lo", "up"],
                            ["ip", "-n", "tt-core", "addr", "add", "10.77.0.1/32", "dev", "lo"]]
    assert len(commands) == 3 + 2 * 10
    # Region 1 (us): 10.77.2.0/30, its rate on the region's end (uplink) and the core's (downlink).
    bucket = ["root", "tbf", "rate", "1mbit", "burst", "32kb", "limit", "256kb"]
    assert ["ip", "-n", "tt-r1", "route", "add", "10.77.0.1/32", "via", "10.77.2.1"] in commands
    assert ["tc", "-n", "tt-r1", "qdisc", "add", "dev", "ttr1", *bucket] in commands
    assert ["tc", "-n", "tt-core", "qdisc", "add", "dev", "ttc1", *bucket] in commands
    assert net.describe()["links"]["us"]["interfaces"] == ["ttc1", "ttr1"]


class FakeNet:
    regions = ["eu", "us"]

    def __init__(self):
        self.calls = []

    def set_link(self, region, up):
        self.calls.append((region, up))


def test_cuts_take_a_link_down_and_up_at_their_times(tmp_path):
    net, log = FakeNet(), tmp_path / "wan.jsonl"
    cuts = wan_sim.Cuts(net, [("us", 5.0, 10.0)], str(log))
    for elapsed in (4.0, 5.2, 14.9, 15.1, 20.0):
        cuts.tick(elapsed)
    assert net.calls == [("us", False), ("us", True)]
    events = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["event"], e.get("t")) for e in events] == [("links_up", None), ("cut", 5.2), ("restored", 15.1)]
    assert events[1]["seconds"] == 10.0


def test_rates_and_sizes_as_tc_writes_them():
    assert all(wan_sim.RATE_RE.match(r) for r in ("20mbit", "715kbit", "2.5gbit"))
    assert not any(wan_sim.RATE_RE.match(r) for r in ("20", "fast", "20 mbit"))
    assert all(wan_sim.SIZE_RE.match(s) for s in ("32kb", "256kb", "1500"))
    assert not wan_sim.SIZE_RE.match("32 kb")
