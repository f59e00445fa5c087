from gpu_worker.service import main

main()
