"""The edge's key headers as the queue service reads them (``clients.admission``): the key's
label and its share of the tier, each one value, anything else refused with a clear status."""

from __future__ import annotations

import grpc
import pytest

from queue_service.clients.admission import (
    MAX_REQUEST_ID_LEN,
    AdmissionError,
    check_request_id,
    key_id_from_metadata,
    key_weight_from_metadata,
    scoped_request_id,
)


def test_the_weight_defaults_to_one_and_reads_the_gateways_header():
    assert key_weight_from_metadata(()) == 1.0
    assert key_weight_from_metadata((("x-tierflow-key-weight", "2.5"),)) == 2.5
    assert key_weight_from_metadata((("X-Tierflow-Key-Weight", b"3"),)) == 3.0


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "1001", "two", ""])
def test_a_weight_that_is_not_one_positive_number_is_invalid_argument(value):
    with pytest.raises(AdmissionError) as err:
        key_weight_from_metadata((("x-tierflow-key-weight", value),))
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    assert "x-tierflow-key-weight" in err.value.message


def test_two_weights_are_invalid_argument():
    twice = (("x-tierflow-key-weight", "1"), ("x-tierflow-key-weight", "2"))
    with pytest.raises(AdmissionError):
        key_weight_from_metadata(twice)


def test_the_key_label_is_one_label():
    assert key_id_from_metadata((("x-tierflow-key-id", "acme"),)) == "acme"
    assert key_id_from_metadata(()) == ""
    with pytest.raises(AdmissionError):
        key_id_from_metadata((("x-tierflow-key-id", "a b"),))


def test_no_id_a_client_can_send_names_another_scopes_request():
    """Each key's ids live in its own scope (``<label>/<id>``), and unscoped callers (no edge)
    in the names without a separator: a client's id may not carry one."""
    assert scoped_request_id("acme", "x") == "acme/x"
    assert scoped_request_id("", "x") == "x"
    with pytest.raises(AdmissionError) as err:
        check_request_id("acme/x")  # unscoped, it would have named acme's request x
    assert err.value.code is grpc.StatusCode.INVALID_ARGUMENT
    check_request_id("x" * MAX_REQUEST_ID_LEN)
    with pytest.raises(AdmissionError):
        check_request_id("x" * (MAX_REQUEST_ID_LEN + 1))
