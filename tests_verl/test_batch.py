"""Our batch as verl's DataProto and as TransferQueue rows: shapes, masks, positions, reward
placement; and the batch rounding that prefers dropping zero-variance groups."""

from __future__ import annotations

import torch
from conftest import rollout

from voltrl.algorithms.verl.batch import rollout_records, rows_to_drop, session_of, to_dataproto
from voltrl.trajectory import collate


def _batch():
    trajectories = [
        rollout("r0", "task-a", [1.0]),
        rollout("r1", "task-a", [0.0, 0.0]),
        rollout("r2", "task-b", [0.5, 0.5, 0.5]),
    ]
    return collate(trajectories)


def test_dataproto_shapes_masks_positions_and_rewards():
    from verl.utils.model import compute_position_id_with_mask

    batch = _batch()
    data = to_dataproto(batch)
    b, p, r = len(batch), batch.prompt_length, batch.response_length
    assert len(data) == b == 6
    shapes = {k: tuple(v.shape) for k, v in data.batch.items()}
    for key in ("prompts",):
        assert shapes[key] == (b, p)
    for key in (
        "responses",
        "response_mask",
        "rollout_log_probs",
        "rm_scores",
        "token_level_rewards",
    ):
        assert shapes[key] == (b, r)
    for key in ("input_ids", "attention_mask", "position_ids"):
        assert shapes[key] == (b, p + r)
    assert torch.equal(
        data.batch["input_ids"], torch.cat([data.batch["prompts"], data.batch["responses"]], 1)
    )
    # verl's own position ids from the attention mask
    assert torch.equal(
        data.batch["position_ids"], compute_position_id_with_mask(data.batch["attention_mask"])
    )
    # prompts left-padded, responses right-padded
    attn = data.batch["attention_mask"]
    for i in range(b):
        n_prompt = len([t for t in batch.prompt_mask[i] if t])
        assert attn[i, :p].tolist() == [0] * (p - n_prompt) + [1] * n_prompt
    # the reward sits on the last trained token, and nowhere else
    mask = data.batch["response_mask"]
    scores = data.batch["rm_scores"]
    for i in range(b):
        last = int(mask[i].nonzero().max())
        assert scores[i].nonzero().flatten().tolist() in ([last], [])
        assert float(scores[i].sum()) == batch.rewards[i]
    assert mask[1].tolist()[:3] == [1, 0, 1]  # context tokens stay masked
    assert list(data.non_tensor_batch["uid"]) == batch.group_ids
    assert list(data.non_tensor_batch["rollout_id"]) == batch.rollout_ids
    assert data.meta_info["voltrl_stats"]["rows"] == 6


def test_rollout_records_match_the_padded_batch():
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    traj = rollout("r1", "task-a", [0.0, 1.0])
    keys, fields, tags = rollout_records(
        traj, uid="u1", session_id=2, global_steps=5, prompt_fields={"data_source": "voltrl"}
    )
    assert keys == ["u1_2_0", "u1_2_1"] and {session_of(k) for k in keys} == {"u1_2"}
    assert [t["seq_len"] for t in tags] == [len(f["input_ids"]) for f in fields]
    assert all(t["status"] == "success" and t["min_global_steps"] == 5 for t in tags)
    td = list_of_dict_to_tensordict(fields)  # verl's own conversion to nested tensors
    responses = td["responses"].to_padded_tensor(padding=0)
    dense = to_dataproto(collate([traj]))
    assert torch.equal(responses, dense.batch["responses"])
    assert torch.equal(td["rm_scores"].to_padded_tensor(padding=0.0), dense.batch["rm_scores"])
    assert torch.equal(
        td["response_mask"].to_padded_tensor(padding=0), dense.batch["response_mask"]
    )
    assert (
        fields[0]["data_source"] == "voltrl"
        and fields[1]["extra_fields"]["voltrl_rollout_id"] == "r1"
    )


def test_rows_to_drop_prefers_whole_zero_variance_groups():
    groups = ["a", "a", "b", "b", "b", "c", "c", "d"]
    rewards = [1.0, 0.0, 0.5, 0.5, 0.5, 0.0, 0.0, 1.0]  # b, c and d carry no signal
    assert rows_to_drop(groups, rewards, 0) == []
    assert rows_to_drop(groups, rewards, 1) == [7]  # the smallest flat group, whole
    assert rows_to_drop(groups, rewards, 2) == [5, 6]
    assert rows_to_drop(groups, rewards, 3) == [5, 6, 7]
    assert rows_to_drop(groups, rewards, 4) == [2, 3, 4, 7]
    dropped = rows_to_drop(groups, rewards, 7)
    assert len(dropped) == 6 and 0 not in dropped and 1 not in dropped  # never a signal row
