"""What the operator refuses to run, whatever a namespace's users write (pure; issue 25).

Whoever may create a Specialist or EnsembleRouter chooses the images of pods the operator creates,
and an EnsembleRouter's pods hold its API keys: an image outside the operator's allowlist would run
attacker code next to them. So `spec.image` must start with an allowed prefix (the operator's own
engine and router images are always allowed), and a TorchScript classifier (`torch.jit.load` runs
code from a ConfigMap inside the router pod) needs an explicit operator flag. A refused object gets
no children written and says why in its status.
"""
from __future__ import annotations

from ..api.router import EnsembleRouterSpec
from ..api.specialist import SpecialistSpec
from ..resources.common import BuildContext

ANY_IMAGE = "*"


def image_repository(image: str) -> str:
    """`registry/org/name` of an image reference, without its tag or digest."""
    name = image.split("@", 1)[0]
    head, sep, tail = name.rpartition("/")
    return f"{head}{sep}{tail.split(':', 1)[0]}"


def allowed_prefixes(ctx: BuildContext) -> tuple[str, ...]:
    return (*ctx.allowed_images, image_repository(ctx.engine_image), image_repository(ctx.router_image))


def image_allowed(image: str, prefixes: tuple[str, ...]) -> bool:
    """True when `image` is an entry or continues one at a path, tag or digest boundary, so that
    `ghcr.io/org/engine` allows `ghcr.io/org/engine:1.2` but not `ghcr.io/org/engine-evil`, and
    `registry.example.com` does not allow `registry.example.com.evil.io/x`."""
    for p in prefixes:
        if p == ANY_IMAGE or image == p:
            return True
        if p and image.startswith(p) and (p[-1] in "/:@" or image[len(p)] in "/:@"):
            return True
    return False


def image_refusal(image: str | None, ctx: BuildContext) -> str | None:
    if image is None or image_allowed(image, allowed_prefixes(ctx)):
        return None
    return (f"image {image!r} is not in the operator's allowed images ({', '.join(allowed_prefixes(ctx))}); "
            "see --allowed-image / the chart's allowedImages")


def specialist_refusal(spec: SpecialistSpec, ctx: BuildContext) -> tuple[str, str] | None:
    """(reason, message) when the operator must not run this Specialist; None when it may."""
    msg = image_refusal(spec.image, ctx)
    return ("ImageNotAllowed", msg) if msg else None


def router_refusal(spec: EnsembleRouterSpec, ctx: BuildContext) -> tuple[str, str] | None:
    msg = image_refusal(spec.image, ctx)
    if msg:
        return "ImageNotAllowed", msg
    if spec.classifier.kind == "torch" and not ctx.allow_torch_classifier:
        return ("TorchClassifierNotAllowed", "classifier.kind torch loads a TorchScript module (code) from a "
                "ConfigMap into the router pod, which holds the API keys; the operator refuses it unless "
                "started with --allow-torch-classifier (chart: allowTorchClassifier)")
    return None
