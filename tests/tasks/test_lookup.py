"""The look-up task: answers decided by the catalogue, disjoint splits, demonstrations that look up both items."""

from rlalign.tasks import lookup as L


def test_answers_follow_the_catalogue():
    for record in L.prompt_records("train", 50):
        a, b = record["items"]
        attribute, larger = L.KINDS[record["kind"]]
        values = {a: L.CATALOGUE[a][attribute], b: L.CATALOGUE[b][attribute]}
        want = max(values, key=values.get) if larger else min(values, key=values.get)
        assert record["answer"] == want and record["prompt"][0]["content"] == L.question(record["kind"], a, b)


def test_lookup_tool_and_its_schema():
    w, p = L.CATALOGUE["brom"]["weight"], L.CATALOGUE["brom"]["price"]
    assert L.lookup(" Brom ") == f"weight={w} price={p}"
    assert L.lookup("nope").startswith("error: no item named")
    from transformers.utils import get_json_schema

    schema = get_json_schema(L.lookup)["function"]
    assert schema["name"] == "lookup" and schema["parameters"]["required"] == ["name"]


def test_splits_are_disjoint_and_demonstrations_look_up_both_items():
    train = {frozenset(r["items"]) for r in L.prompt_records("train", 400)}
    evals = {frozenset(r["items"]) for r in L.prompt_records("eval", 100)}
    assert train and evals and not train & evals
    records = L.sft_records("train", 200, tool_share=0.5)
    with_tools = [r["messages"] for r in records if len(r["messages"]) == 6]
    assert 60 < len(with_tools) < 140 and all(len(r["messages"]) in (2, 6) for r in records)
    for m in with_tools:
        a = m[1]["content"]
        assert a.startswith("<tool>lookup: ") and m[2]["role"] == "tool" and m[2]["content"] == L.lookup(a[14:-7])
    env = L.LookupEnvironment()
    record = L.prompt_records("eval", 1)[0]
    assert env.reset(record) == record["prompt"] and env.reward(" " + record["answer"].upper()) == 1.0 and env.reward("x") == 0.0
    assert L.reward(["q"], [record["answer"]], answer=[record["answer"]]) == [1.0]


def test_value_questions_are_answered_by_the_winners_number_copied_from_a_look_up():
    from rlalign.tasks import TASKS

    for record in TASKS["lookup_value"].prompt_records("train", 50):
        a, b = record["items"]
        attribute, larger = L.KINDS[record["kind"]]
        pick = max if larger else min
        assert record["answer"] == str(pick(L.CATALOGUE[a][attribute], L.CATALOGUE[b][attribute]))
        assert record["prompt"][0]["content"] == f"What is the {attribute} of the {record['kind']} of the {a} and the {b}?"
    # same pairs and kinds as the which-questions of the same draw, so the splits stay disjoint
    assert [r["items"] for r in L.prompt_records("eval", 20, question_form="value")] == [r["items"] for r in L.prompt_records("eval", 20)]
    records = TASKS["lookup_value"].sft_records("train", 200, tool_share=0.5)
    for m in (r["messages"] for r in records):
        if len(m) == 6:  # the answer is the winner's number, as written in one of the two tool results
            kind = m[0]["content"].split()[6]  # "What is the weight of the heavier of ..." -> "heavier"
            attribute, larger = L.KINDS[kind]
            seen = [int(dict(v.split("=") for v in t["content"].split())[attribute]) for t in (m[2], m[4])]
            assert m[-1]["content"] == str(max(seen) if larger else min(seen))
        else:  # a guess without look-ups: a number from 1 to 99
            assert len(m) == 2 and 1 <= int(m[1]["content"]) <= 99
    env = L.LookupEnvironment()
    record = TASKS["lookup_value"].prompt_records("eval", 1)[0]
    env.reset(record)
    assert env.reward(f" {record['answer']} ") == 1.0 and env.reward(str(int(record["answer"]) + 1)) == 0.0


def test_single_questions_ask_one_items_value_found_by_one_look_up():
    for record in L.prompt_records("train", 50, question_form="single"):
        a, _ = record["items"]
        attribute = L.KINDS[record["kind"]][0]
        assert record["prompt"][0]["content"] == f"What is the {attribute} of the {a}?"
        assert record["answer"] == str(L.CATALOGUE[a][attribute])
    records = L.sft_records("train", 200, tool_share=0.5, question_form="single")
    looked_up = [r["messages"] for r in records if len(r["messages"]) == 4]
    assert 60 < len(looked_up) < 140 and all(len(r["messages"]) in (2, 4) for r in records)
    for m in looked_up:  # the call names the asked item, the answer is its value as the tool wrote it
        attribute, name = m[0]["content"].split()[3], m[0]["content"].split()[-1][:-1]
        assert m[1]["content"] == L.tag_call(name) and m[2]["content"] == L.lookup(name)
        assert m[3]["content"] == dict(v.split("=") for v in m[2]["content"].split())[attribute]
