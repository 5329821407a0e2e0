"""The generated traces are valid Mooncake records with the sharing each workload promises."""
import json
from collections import Counter

import pytest

from quillcache.control.sim.gen import GENERATORS, agent_trace, apps_trace, rag_trace, unique_trace
from quillcache.control.sim.trace import TRACE_BLOCK_TOKENS as B, parse_trace


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generated_traces_parse_as_mooncake_records_and_repeat_by_seed(name):
    gen = GENERATORS[name]
    trace = gen(400, seed=3)
    lines = [json.dumps({"timestamp": t.timestamp_ms, "input_length": t.input_length,
                         "output_length": t.output_length, "hash_ids": list(t.hash_ids)}) for t in trace]
    assert parse_trace(lines) == trace                    # block counts, time order, fields
    assert gen(400, seed=3) == trace and gen(400, seed=4) != trace


def test_rag_requests_share_a_few_long_documents_and_own_their_question():
    trace = rag_trace(600, seed=1, documents=10)
    starts = Counter(t.hash_ids[:3] for t in trace)
    assert len(starts) <= 10 and max(starts.values()) > 600 / 10      # Zipf: a hot document
    tails = Counter(t.hash_ids[-1] for t in trace)
    assert max(tails.values()) == 1                                   # each question is its own


def test_agent_turns_extend_their_session_context():
    trace = agent_trace(500, seed=2, sessions=8)
    by_prefix = {}
    extended = 0
    for t in trace:
        full = t.hash_ids[:t.input_length // B]
        for n in range(len(full), 0, -1):
            if full[:n] in by_prefix:
                extended += n > 6                                     # more than the shared system prompt
                break
        for n in range(1, len(full) + 1):
            by_prefix[full[:n]] = True
    assert extended > 0.8 * len(trace)
    assert max(t.input_length for t in trace) <= 64_000 + B


def test_apps_templated_calls_share_their_template_and_chat_shares_one_block():
    trace = apps_trace(2000, seed=5, templates=((12, 0.4), (5, 0.15)))
    groups = Counter(t.hash_ids[0] for t in trace)
    system, first, second = sorted(groups)                # ids in the order they were taken
    assert set(groups) == {system, first, second}
    assert abs(groups[first] / 2000 - 0.4) < 0.04 and abs(groups[second] / 2000 - 0.15) < 0.03
    firsts = [t for t in trace if t.hash_ids[0] == first]
    assert len({t.hash_ids[:12] for t in firsts}) == 1 and all(t.output_length < 40 for t in firsts)
    chat = [t for t in trace if t.hash_ids[0] == system]
    own = Counter(h for t in chat for h in t.hash_ids[1:])
    assert max(own.values()) == 1                         # a chat prompt shares only the system block
    assert 900 <= min(t.input_length for t in chat) and max(t.input_length for t in chat) <= 120_000
    assert all(t.output_length >= 200 for t in chat)
    with pytest.raises(ValueError, match="no share for chat"):
        apps_trace(10, templates=((4, 0.6), (2, 0.4)))


def test_unique_prompts_share_at_most_the_system_block():
    trace = unique_trace(3000, seed=2)
    system = Counter(t.hash_ids[0] for t in trace).most_common(1)[0][0]
    starting = [t for t in trace if t.hash_ids[0] == system]
    assert abs(len(starting) / 3000 - 2 / 3) < 0.04
    own = Counter(h for t in trace for h in (t.hash_ids[1:] if t.hash_ids[0] == system else t.hash_ids))
    assert max(own.values()) == 1 and system not in own       # no other block is shared
    assert 200 <= min(t.input_length for t in trace) and max(t.input_length for t in trace) <= 9000
    assert 5 <= min(t.output_length for t in trace) and max(t.output_length for t in trace) <= 300
    span_s = (trace[-1].timestamp_ms - trace[0].timestamp_ms) / 1000
    assert abs(3000 / span_s - 2.5) < 0.2                     # Poisson at 2.5 a second
    with pytest.raises(ValueError, match="system_share"):
        unique_trace(10, system_share=1.5)
