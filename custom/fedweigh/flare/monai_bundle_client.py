"""Entry script of the MONAI Bundle client (shipped in the job's custom/ folder next to the bundle)."""

from fedweigh.flare.monai_bundle import main

if __name__ == "__main__":
    main()
