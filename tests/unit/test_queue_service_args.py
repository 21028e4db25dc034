"""The queue service's command line: what it hands the scheduler."""

from queue_service.scheduler import SchedulerConfig
from queue_service.server import parse_args


def test_the_predictor_is_refit_from_finished_prefills_unless_told_not_to():
    assert parse_args(["--plaintext"]).refit_predictor is SchedulerConfig.refit_predictor is True
    fixed = parse_args(["--plaintext", "--predictor", "predictor.json", "--no-refit-predictor"])
    assert (str(fixed.predictor_file), fixed.refit_predictor) == ("predictor.json", False)
