"""Bad arguments fail at once with an error naming the argument and what it accepts.

Covers ``ftcomm.init``'s arguments, :class:`ftcomm.GroupOptions`, ``parse_address`` and
the ``ftcomm`` command line. Nothing here may hang or reach the network: every check runs
before a socket, a store or a gossip thread exists.
"""

from __future__ import annotations

import time

import pytest

import ftcomm
from ftcomm import AddressError, GroupOptions, check_worker_counts
from ftcomm.gossip import FaultFilter, GossipConfig
from ftcomm.gossip.runtime import parse_address
import ftcomm.group
from ftcomm.ops.cli import main

pytestmark = pytest.mark.timeout(30)

BOUND_S = 5.0  # generous: a refused argument takes milliseconds; the bug this guards against took 16-21 s
PORT_RANGE = "0 <= PORT <= 65535"


def refused(error: type[Exception], match: str, **kwargs) -> pytest.ExceptionInfo:
    """``ftcomm.init(**kwargs)`` raises ``error`` with ``match`` in its message, well within BOUND_S."""
    started = time.monotonic()
    with pytest.raises(error, match=match) as info:
        ftcomm.init(**{"handle_signals": False, **kwargs})
    assert time.monotonic() - started < BOUND_S
    return info


@pytest.fixture
def no_store(monkeypatch):
    """Fail the test if the group gets as far as creating its rendezvous store."""
    def created(*args, **kwargs):
        raise AssertionError("the rendezvous store was created before the arguments were checked")
    monkeypatch.setattr(ftcomm.group, "Rendezvous", created)


@pytest.fixture
def clean_env(monkeypatch):
    for name in ("FTCOMM_PEERS", "FTCOMM_BIND", "FTCOMM_CLUSTER"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# ------------------------------------------------------------------ parse_address
@pytest.mark.parametrize("address, expected", [
    ("10.0.0.4:7946", ("10.0.0.4", 7946)),
    ("localhost:0", ("localhost", 0)),
    ("h:65535", ("h", 65535)),
    (" h:80 ", ("h", 80)),
    ("[::1]:80", ("[::1]", 80)),
    ("127.0.0.1:7946/5f0c2a11", ("127.0.0.1", 7946)),  # a member id, as `ftcomm members` prints it
    (("h", 80), ("h", 80)),
    (("h", "80"), ("h", 80)),
])
def test_parse_address_accepts_host_and_port(address, expected):
    assert parse_address(address) == expected


@pytest.mark.parametrize("address, reason", [
    ("h:99999", "out of range"), ("h:65536", "out of range"), ("h:-1", "not a number"),
    ("h:abc", "not a number"), ("h:", "not a number"), ("h:8O", "not a number"), ("h:²", "not a number"),
    (":80", "empty host"), ("host", "no port"), ("", "no port"), (("h", 99999), "out of range"),
    (("", 80), "empty host"), (("h", -1), "out of range"),
])
def test_parse_address_refuses_a_malformed_address_naming_it_and_the_form(address, reason):
    with pytest.raises(ValueError) as info:
        parse_address(address)
    message = str(info.value)
    assert repr(address) in message and reason in message and PORT_RANGE in message


@pytest.mark.parametrize("address", [None, 7946, ("h",), ("h", 80, 1), ("h", True), (80, "h"), ["h", 80], b"h:80"])
def test_parse_address_refuses_what_is_not_an_address_with_a_type_error(address):
    with pytest.raises(TypeError, match="bad address"):
        parse_address(address)


# ------------------------------------------------------------------ GroupOptions
@pytest.mark.parametrize("name, value, error, accepted", [
    ("init_timeout", -1, ValueError, "> 0"),
    ("init_timeout", 0, ValueError, "> 0"),
    ("init_timeout", float("nan"), ValueError, "finite"),
    ("init_timeout", float("inf"), ValueError, "finite"),
    ("init_timeout", "5", TypeError, "number"),
    ("init_timeout", True, TypeError, "number"),
    ("formation_timeout", 0.0, ValueError, "> 0"),
    ("quorum_timeout", -300, ValueError, "> 0"),
    ("settle_interval", -0.1, ValueError, ">= 0"),
    ("leave_grace", float("-inf"), ValueError, ">= 0"),
    ("step_publish_interval", None, TypeError, "number"),
    ("bucket_mb", 0, ValueError, "> 0"),
    ("bucket_mb", "25", TypeError, "MB"),
    ("max_retries", -1, ValueError, "int >= 0"),
    ("max_retries", 2.5, TypeError, "int >= 0"),
    ("max_retries", False, TypeError, "int >= 0"),
    ("overlap", "yes", TypeError, "True or False"),
    ("overlap", 1, TypeError, "True or False"),
    ("handle_signals", None, TypeError, "True or False"),
    ("partition_policy", "majority", ValueError, "'quorum' or 'availability'"),
    ("gossip", {"probe_interval": 1.0}, TypeError, "GossipConfig"),
    ("gossip", None, TypeError, "GossipConfig"),
    ("fault_filter", 0.1, TypeError, "FaultFilter"),
])
def test_group_options_refuse_a_bad_value_naming_the_option_and_what_it_accepts(name, value, error, accepted):
    with pytest.raises(error) as info:
        GroupOptions(**{name: value})
    assert str(info.value).startswith(name) and accepted in str(info.value)


def test_group_options_accept_their_defaults_and_the_edges_of_their_ranges():
    GroupOptions()
    GroupOptions(settle_interval=0, leave_grace=0.0, step_publish_interval=0, max_retries=0, init_timeout=1,
                 bucket_mb=0.0002, partition_policy="availability", overlap=False, handle_signals=False,
                 gossip=GossipConfig(), fault_filter=FaultFilter())


def test_init_turns_a_gossip_dict_into_a_gossip_config_and_refuses_an_unknown_field(no_store):
    refused(ValueError, "unknown GossipConfig option.*probe_intervall", gossip={"probe_intervall": 1.0})
    # fault_filter is checked after gossip: reaching it means the dict became a GossipConfig
    refused(TypeError, "fault_filter must be None or a FaultFilter", gossip={"probe_interval": 1.0}, fault_filter=1)


# ------------------------------------------------------------------ init's arguments
@pytest.mark.parametrize("kwargs, error, match", [
    ({"init_timeout": -1}, ValueError, r"init_timeout must be > 0"),
    ({"max_retries": "3"}, TypeError, r"max_retries must be an int >= 0"),
    ({"partition_policy": "quorom"}, ValueError, r"partition_policy must be 'quorum' or 'availability'"),
    ({"min_workers": "2"}, TypeError, r"min_workers must be an int >= 1"),
    ({"min_workers": True}, TypeError, r"min_workers must be an int >= 1"),
    ({"min_workers": 0}, ValueError, r"min_workers must be an int >= 1"),
    ({"min_workers": 2.0}, TypeError, r"min_workers must be an int >= 1"),
    ({"max_workers": "4"}, TypeError, r"max_workers must be None or an int >= min_workers \(1\)"),
    ({"min_workers": 3, "max_workers": 2}, ValueError, r"max_workers must be None or an int >= min_workers \(3\)"),
    ({"backend": 1}, TypeError, r"backend must be a string, one of gloo, nccl"),
    ({"backend": "mpi"}, ValueError, r"unknown backend 'mpi': use one of gloo, nccl"),
    ({"peers": 7946}, TypeError, r"peers must be a 'HOST:PORT' string"),
    ({"peers": b"10.0.0.4:7946"}, TypeError, r"peers must be a 'HOST:PORT' string"),
    ({"peers": [("10.0.0.4", 7946)]}, TypeError, r"peers must hold 'HOST:PORT' strings"),
    ({"peers": ["10.0.0.4:99999"]}, ValueError, r"peers: bad address '10.0.0.4:99999'.*0 <= PORT <= 65535"),
    ({"peers": "10.0.0.4:7946,10.0.0.5"}, ValueError, r"peers: bad address '10.0.0.5': no port"),
    ({"peers": "dns://workers.default.svc"}, ValueError, r"peers: bad address 'workers.default.svc': no port"),
    ({"peers": ["dns://workers:0"]}, ValueError, r"peers: bad seed 'dns://workers:0'.*gossip port"),
    ({"bind": "127.0.0.1:99999"}, ValueError, r"bind: bad address '127.0.0.1:99999'.*0 <= PORT <= 65535"),
    ({"bind": ":0"}, ValueError, r"bind: bad address ':0': empty host"),
    ({"bind": ("127.0.0.1", 0)}, TypeError, r"bind must be a 'HOST:PORT' string"),
    ({"cluster": ""}, ValueError, r"cluster must be a non-empty string"),
    ({"cluster": 7}, TypeError, r"cluster must be a non-empty string"),
    ({"no_such_option": 1}, ValueError, r"unknown option\(s\) no_such_option"),
    ({"group_ran": "yes"}, TypeError, r"group_ran must be True, False or None"),
])
def test_init_refuses_a_bad_argument_at_once_naming_it(clean_env, no_store, kwargs, error, match):
    refused(error, match, **kwargs)


@pytest.mark.parametrize("variable, value, error, match", [
    ("FTCOMM_PEERS", "10.0.0.4:7946,10.0.0.5:-1", ValueError, r"\$FTCOMM_PEERS: bad address '10.0.0.5:-1'"),
    ("FTCOMM_BIND", "127.0.0.1:port", ValueError, r"bind \(from \$FTCOMM_BIND\): bad address"),
    ("FTCOMM_CLUSTER", "", ValueError, r"\$FTCOMM_CLUSTER is set but empty"),
    ("FTCOMM_GROUP_RAN", "maybe", ValueError, r"\$FTCOMM_GROUP_RAN must be 1 or 0"),
])
def test_init_names_the_environment_variable_a_bad_value_came_from(clean_env, no_store, variable, value, error,
                                                                   match):
    clean_env.setenv(variable, value)
    refused(error, match)


@pytest.mark.parametrize("bind, reason", [("nohost:0", "does not resolve"),
                                          ("203.0.113.9:0", "not an address of this machine"),
                                          ("0.0.0.0:0", "wildcard")])
def test_a_bind_address_that_cannot_work_is_refused_before_the_store_is_created(clean_env, no_store, bind, reason):
    """Regression: the rendezvous store was created first and init failed 16-21 s later
    with torch's DistNetworkError instead of AddressError."""
    refused(AddressError, reason, bind=bind)


def test_check_worker_counts_accepts_the_ranges_it_states():
    check_worker_counts(1, None)
    check_worker_counts(2, 2)
    check_worker_counts(2, 8)


# ------------------------------------------------------------------ the command line
@pytest.mark.parametrize("argv, names", [
    (["members", "--peer", "127.0.0.1:9", "--timeout", "-1"], ["--timeout", "> 0"]),
    (["members", "--peer", "127.0.0.1:9", "--timeout", "0"], ["--timeout", "> 0"]),
    (["members", "--peer", "127.0.0.1:9", "--timeout", "nan"], ["--timeout", "> 0"]),
    (["members", "--peer", "127.0.0.1:9", "--timeout", "soon"], ["--timeout", "> 0"]),
    (["members", "--peer", "127.0.0.1:99999"], ["--peer", PORT_RANGE]),
    (["members", "--peer", "127.0.0.1:-5"], ["--peer", PORT_RANGE]),
    (["members", "--peer", ":7946"], ["--peer", "empty host"]),
    (["members", "--peer", "nonsense"], ["--peer", "HOST:PORT"]),
    (["members", "--peer", "127.0.0.1:9", "--cluster", ""], ["--cluster", "non-empty"]),
    (["demo", "gossip", "--members", "1"], ["--members", ">= 2"]),
    (["demo", "--steps", "0"], ["--steps", ">= 1"]),
    (["demo", "--steps", "many"], ["--steps", ">= 1"]),
])
def test_cli_refuses_a_bad_argument_with_status_2_naming_it(capsys, argv, names):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ftcomm") and all(name in err for name in names), err


def test_cli_help_and_version_exit_0(capsys):
    assert main(["--version"]) == 0
    assert ftcomm.__version__ in capsys.readouterr().out
    assert main(["members", "--help"]) == 0


def test_a_bad_straggler_policy_or_cooldown_is_refused():
    from ftcomm.options import GroupOptions

    with pytest.raises(ValueError, match="straggler_policy must be 'warn' or 'exclude'"):
        GroupOptions(straggler_policy="kick")
    with pytest.raises(ValueError, match="straggler_cooldown"):
        GroupOptions(straggler_cooldown=0)
