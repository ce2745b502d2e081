"""The data package's exceptions: bad input (a record, a conversation, an image), named
with its place and kind so the loader's ``bad_input`` policy can count or skip it, and a
loader state that cannot be resumed."""

from __future__ import annotations

from ..errors import FlowError


class MalformedRecord(FlowError, ValueError):
    """A record that is not valid JSON or not a JSON object: ``str()`` is ``place: reason``;
    ``reason`` alone is what a report that names the place itself adds."""

    def __init__(self, place: str, reason: str) -> None:
        super().__init__(place, reason)
        self.place, self.reason = place, reason

    def __str__(self) -> str:
        return f"{self.place}: {self.reason}"


class BadConversation(FlowError, ValueError):
    """A conversation that cannot be trained on (no usable turns, image placeholders that do
    not match the images); ``kind`` is the bad-input kind the loader counts it under."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class BadImage(FlowError, ValueError):
    """An image file that is missing, cannot be decoded, or cannot be resized."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ResumeMismatch(FlowError, ValueError):
    """A loader state that this loader cannot resume from: another state format, settings
    that differ from the saved ones (each named with both values), or held samples that no
    longer decode as they did.  Resuming anyway would yield other packs than the
    uninterrupted run, so the loader refuses instead."""


class ProcessorConfigError(FlowError, ValueError):
    """The job's image processor lacks a value the loader needs to cut images the way the
    model wants them (patch, merge or temporal size, mean/std, pixel bounds): the message
    names the processor's file and the key."""


class UnsupportedTemplate(FlowError, ValueError):
    """A chat template (MindSpeed-MM's ``basic_parameters.template``) whose text the loader
    does not reproduce: training would silently see other tokens than upstream's, so the
    loader refuses at start-up, naming the setting, its value and the supported names."""
