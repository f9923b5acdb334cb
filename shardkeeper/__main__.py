from shardkeeper.cli import run

run()
