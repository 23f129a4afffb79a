"""write_json streams what it encodes: the bytes of json.dumps(value, indent=1) + newline,
with a JsonStream (a per-client list made item by item) never whole in memory."""

import json

import numpy as np

from fedhier.runs.folder import JsonStream, write_json


def test_a_streamed_array_writes_the_bytes_of_the_whole_list(tmp_path):
    rows = [np.arange(j, dtype=np.int64) for j in range(5)]
    made = []

    def item(j):
        made.append(j)
        return {"client": j, "rows": rows[j], "weight": np.float64(j) / 3, "name": "é"}

    value = {"scheme": "iid", "clients": JsonStream(5, item), "none": JsonStream(0, item),
             "holdout": [], "nested": (np.int64(2), [np.float32(0.5)])}
    write_json(tmp_path / "p.json", value)
    whole = {**value, "clients": [item(j) for j in range(5)], "none": []}
    expected = json.dumps({k: v for k, v in whole.items()}, indent=1,
                          default=lambda o: o.tolist() if hasattr(o, "tolist") else o.item())
    assert (tmp_path / "p.json").read_bytes() == (expected + "\n").encode()
    assert made == [0, 1, 2, 3, 4] * 2  # written once item by item, then the reference
