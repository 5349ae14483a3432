"""rdma_cni.kube.status: the one status classifier both Kubernetes clients type their failures by."""

from __future__ import annotations

import pytest

from rdma_cni.kube import client as kubeapi
from rdma_cni.kube.status import MAX_FOREIGN_TEXT, Status, classify, describe, snippet


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        (200, Status.OK),
        (201, Status.OK),
        (404, Status.NOT_FOUND),
        (409, Status.CONFLICT),
        (410, Status.GONE),
        (422, Status.INVALID),
        (401, Status.REFUSED),
        (403, Status.REFUSED),
        (429, Status.RETRY),
        (500, Status.RETRY),
        (503, Status.RETRY),
        (599, Status.RETRY),
        (400, Status.OTHER),
        (405, Status.OTHER),
        (418, Status.OTHER),
        (302, Status.OTHER),
    ],
)
def test_classify(code: int, expected: Status) -> None:
    assert classify(code) is expected


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (404, kubeapi.NotFound),
        (409, kubeapi.Conflict),
        (410, kubeapi.Gone),
        (422, kubeapi.Invalid),
        (429, kubeapi.Unavailable),
        (502, kubeapi.Unavailable),
        (401, kubeapi.ApiError),
        (403, kubeapi.ApiError),
        (400, kubeapi.ApiError),
    ],
)
def test_the_long_running_client_types_errors_by_the_classifier(code: int, error: type) -> None:
    assert kubeapi._error_class(code) is error
    # Retried by the pod GET exactly when the long-running client says Unavailable.
    assert (classify(code) is Status.RETRY) == (error is kubeapi.Unavailable)


def test_snippet_folds_whitespace_and_cuts_long_text() -> None:
    assert snippet(" a\n\tb  c ") == "a b c"
    long = "x" * (MAX_FOREIGN_TEXT + 50)
    assert snippet(long) == "x" * MAX_FOREIGN_TEXT + "..."


def test_describe_names_the_class() -> None:
    assert describe(ConnectionResetError("reset by peer")) == "ConnectionResetError: reset by peer"
