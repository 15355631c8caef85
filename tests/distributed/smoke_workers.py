def rank_and_size():
    from tests.distributed.launcher import worker_setup

    worker_setup()
    import keras_spatial as ks

    strategy = ks.SpatialStrategy((2, 1, 1))
    return strategy.rank, strategy.size, strategy.coords
