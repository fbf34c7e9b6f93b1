"""Entry script of the fedweigh NVFlare client (shipped in the job's custom/ folder)."""

from fedweigh.flare.client import main

if __name__ == "__main__":
    main()
