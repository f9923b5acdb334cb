from shardkeeper.entry import main

main()
