"""An async generation's base64 pictures leave its stored body for input files and come back as they were sent."""

from __future__ import annotations

import base64

from stepserve.server.job_pictures import put_pictures, take_pictures


def test_control_and_image_prompt_pictures_go_out_and_come_back():
    a, b, c = (base64.b64encode(bytes([i]) * 40).decode() for i in (1, 2, 3))
    for prompt, roles in (({"name": "face", "image": c}, ["ip_adapter"]),
                          ([{"name": "face", "image": c}, {"name": "style"}], ["ip_adapter-0"])):
        body = {"prompt": "p", "controls": [{"name": "edge", "image": a}, {"name": "pose", "image": f"data:image/png;"
                                                                                               f"base64,{b}"}],
                "ip_adapter": prompt}
        kept, pictures = take_pictures(body)
        assert sorted(pictures) == ["controls-0", "controls-1", *roles]
        assert pictures["controls-1"] == bytes([2]) * 40 and b not in str(kept) and c not in str(kept)
        back = put_pictures(kept, pictures)
        assert back["controls"][0]["image"] == a and back["controls"][1]["image"] == b  # (as base64)
        images = [back["ip_adapter"]] if isinstance(back["ip_adapter"], dict) else back["ip_adapter"]
        assert images[0]["image"] == c and body["controls"][0]["image"] == a  # the body sent is untouched
    assert take_pictures({"prompt": "p"}) == ({"prompt": "p"}, {})
