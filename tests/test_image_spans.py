"""Image spans: validation and whole-image windows."""

import pytest

from runtime.image_spans import ImageSpan, ImageSpanError, check_spans, windows

D = "0123456789abcdef" * 4


def spans(*pairs: tuple[int, int]) -> list[ImageSpan]:
    return [ImageSpan(s, n, D) for s, n in pairs]


def test_windows_group_whole_images_up_to_the_storage() -> None:
    s = spans((2, 4), (6, 3), (10, 4))
    assert windows(s, 7) == ((0, 2), (2, 3))
    assert windows(s, 11) == ((0, 3),)
    assert windows(s, 4) == ((0, 1), (1, 2), (2, 3))
    assert windows([], 4) == ()


def test_an_image_larger_than_the_storage_is_named() -> None:
    with pytest.raises(ImageSpanError, match=r"images\[1\]: 9 feature rows exceed the window's 8"):
        windows(spans((0, 4), (4, 9)), 8)


@pytest.mark.parametrize(
    ("pairs", "prompt_len", "message"),
    [
        (((0, 4), (3, 2)), 10, r"images\[1\]: starts at 3, inside or before"),
        (((0, 4), (8, 4)), 10, r"images\[1\]: ends at 12, past the prompt's 10"),
    ],
)
def test_spans_out_of_order_or_past_the_prompt_are_refused(pairs, prompt_len, message) -> None:
    with pytest.raises(ImageSpanError, match=message):
        check_spans(spans(*pairs), prompt_len)


def test_fields_are_checked() -> None:
    assert check_spans(spans((0, 4), (4, 4)), 8)[1].end == 8
    with pytest.raises(ImageSpanError, match="length must be >= 1"):
        ImageSpan(0, 0, D)
    with pytest.raises(ImageSpanError, match="digest must be 64 lowercase hex"):
        ImageSpan(0, 1, "ABC")
    with pytest.raises(ImageSpanError, match="start must be an integer"):
        ImageSpan(True, 1, D)
