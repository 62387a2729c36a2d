"""Tests of ``shop.py`` with the package's pytest plugin::

    pip install -e '.[embedded]' pytest  # from a checkout: the plugin's embedded PostgreSQL, and pytest
    pytest examples/test_shop.py

The ``dramatiq_pg_broker`` fixture builds a broker in a schema of its own (``DRAMATIQ_PG_TEST_URL``,
else an embedded PostgreSQL), moves every actor of ``shop``'s broker to it for the test and back
afterwards: ``DATABASE_URL``, which ``shop`` reads at import, is never connected to.
"""

import pytest
import shop


@pytest.fixture(autouse=True)
def _charged():
    shop.CHARGED.clear()


def test_an_order_is_charged(dramatiq_pg_broker, dramatiq_pg_worker):
    shop.charge.send("o-1", 1250)
    dramatiq_pg_broker.join(shop.charge.queue_name)
    assert shop.CHARGED == [("o-1", 1250)]


def test_a_receipt_charges_from_its_actor(dramatiq_pg_broker, dramatiq_pg_worker):
    shop.receipt.send("o-2")
    dramatiq_pg_broker.join(shop.receipt.queue_name)
    dramatiq_pg_broker.join(shop.charge.queue_name)
    assert shop.CHARGED == [("o-2", 100)]


def test_a_charge_of_nothing_fails(dramatiq_pg_broker, dramatiq_pg_worker):
    shop.charge.send("o-3", 0)
    with pytest.raises(ValueError, match="nothing to charge"):
        dramatiq_pg_broker.join(shop.charge.queue_name, fail_fast=True)
