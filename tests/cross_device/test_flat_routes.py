"""`FlatRoutes` and `call_site`: what a repeated bucket reduction keeps, and where it is from."""

from __future__ import annotations

from typing import Any

import pytest

from crossdevice._cross_device.call_site import call_site
from crossdevice._cross_device.flat import FlatRoute, FlatRoutes, total_numel

torch = pytest.importorskip("torch")


def _routes() -> tuple[FlatRoutes, list[tuple[Any, ...]]]:
    made: list[tuple[Any, ...]] = []

    def make(*args: Any) -> FlatRoute:
        made.append(args)
        op, options, site, leaves, wire, _first = args
        return FlatRoute(leaves, options, None, (op, site, wire), None, None, lambda t: t[0])

    return FlatRoutes(make), made


def test_a_route_is_kept_for_the_same_call_and_made_anew_for_any_other() -> None:
    routes, made = _routes()
    leaves = (((3,), "float32"),)
    options = object()
    first = torch.zeros(3)
    route = routes.route("SUM", options, ("a.py", 1), leaves, None, first)
    assert routes.route("SUM", options, ("a.py", 1), leaves, None, first) is route
    assert len(made) == 1
    others = [
        ("MEAN", options, ("a.py", 1), leaves, None, first),
        ("SUM", object(), ("a.py", 1), leaves, None, first),
        ("SUM", options, ("a.py", 2), leaves, None, first),  # another line of the user's
        ("SUM", options, ("a.py", 1), (((3, 1), "float32"),), None, first),
        ("SUM", options, ("a.py", 1), leaves, torch.bfloat16, first),
        ("SUM", options, ("a.py", 1), leaves, None, first.double()),
        ("SUM", options, ("a.py", 1), leaves, None, torch.zeros(3, device="meta")),  # no room
    ]
    for call in others:
        assert routes.route(*call) is not route, call
        assert made[-1] == call
    assert len(made) == 1 + len(others)


def test_unhashable_sites_are_routed_afresh() -> None:
    routes, made = _routes()
    leaves = (((1,), "float32"),)
    for _ in range(2):
        routes.route("SUM", None, ["unhashable"], leaves, None, torch.zeros(1))
    assert len(made) == 2


def test_total_numel_counts_every_part() -> None:
    assert (
        total_numel([torch.zeros(3), torch.zeros(2, 2), torch.nn.Parameter(torch.zeros(5))]) == 12
    )


def _site_from_here() -> Any:
    return call_site()


def test_call_site_names_the_user_frame_by_base_name() -> None:
    site = _site_from_here()
    assert site is not None
    assert site[:2] == ("test_flat_routes.py", "_site_from_here")
    assert _site_from_here() == site  # the same line every time


def test_call_site_walks_past_package_frames() -> None:
    # A frame of the package (as the strategy's own calls are) is no site: the user's is.
    import os

    import crossdevice

    package_file = os.path.join(os.path.dirname(crossdevice.__file__), "_cross_device", "x.py")
    scope: dict[str, Any] = {"call_site": call_site}
    exec(compile("def inner():\n    return call_site()\n", package_file, "exec"), scope)
    site = scope["inner"]()
    assert site is not None
    assert site[:2] == ("test_flat_routes.py", "test_call_site_walks_past_package_frames")


def test_a_purpose_with_a_site_gives_that_site_instead_of_the_walk() -> None:
    from crossdevice._core.purpose import purpose

    with purpose("the gradients", 1, site=("crossdevice.torch", "gradients", 0)):
        assert _site_from_here() == ("crossdevice.torch", "gradients", 0)
        with purpose("inner"):  # an inner block without a site keeps the outer one
            assert _site_from_here() == ("crossdevice.torch", "gradients", 0)
    assert _site_from_here()[:1] == ("test_flat_routes.py",)  # type: ignore[index]
